"""Attacks on the server's round, run through the loop the product runs.

One or two sites of an in-process federation attack every round; everything else is the code a job
runs: :func:`fedweigh.server.loop.run_rounds` with the server's
:class:`~fedweigh.server.rounds.RoundStep` (checks, count clipping, norm bound, direction check, weight
cap, the robust options of the safeguards preset) and :class:`~fedweigh.server.records.RoundRecorder`,
and a :class:`~fedweigh.site.trainer.SiteTrainer` per site (the class the NVFlare client script
drives). The transport is :class:`TamperingSites`, the benchmark's
:class:`~fedweigh.bench.sites.InProcessSites` whose :meth:`~TamperingSites.train` alters the
attackers' results after honest training, with full knowledge of the round's honest results.

Attacks (:data:`ATTACKS`, composed with ``+``, e.g. ``labelflip+forged-count``), on the update
Delta = theta_k - theta_g^{t-1} of every floating-point array the site sends:

- ``alie``, ``ipm``, ``signflip``, ``gaussian``: ByzFL's ``ALittleIsEnough`` (tau 1.5; Baruch et al.,
  NeurIPS 2019), ``InnerProductManipulation`` (epsilon 2; Xie et al., UAI 2019), ``SignFlipping``
  (-mean of the honest updates) and ``Gaussian`` (N(0, 1) per coordinate), applied to the honest
  sites' updates of the round (the attackers send the vector ByzFL returns);
- ``labelflip``: the attackers train on flipped labels (multi-label 1 - y, multi-class C - 1 - y, as
  ByzFL's label-flipping clients) and send that update;
- ``model-replacement``: trained on flipped labels, the update boosted x4 (Bagdasaryan et al.,
  AISTATS 2020);
- ``min-max``, ``min-sum``: mean - gamma * std of the honest updates with the largest gamma whose
  largest distance (sum of squared distances) to the honest updates stays within the honest updates'
  own (Shejwalkar & Houmansadr, NDSS 2021, Algorithm 1, perturbation "inverse std");
- ``classifier-flip``: the classifier's arrays of the attacker's own update negated at 2.9 x its norm
  (just inside a norm bound of 3 x the median, the default before bounded influence), the other
  arrays honest;
- ``forged-count``: the reported sample count x 1000; ``forged-steps``: the reported local step count 1
  (what FedNova's weights read).

:func:`run_attack` runs one attack and returns an :class:`AttackRecord`; the suite runner

    PYTHONPATH=custom .venv/bin/python -m fedweigh.bench.attacks --rounds 10 --seeds 0,1,2 \\
        --sites 4,8 --out attacks.json

runs :data:`SUITE` for every K, number of attackers and seed and prints, last,
``attacks: N tried, C crashed or stalled, worst AUC drop D (one of 4), D8 (one of 8), E (two of 8),
H (HE)`` (worst over the attacks of the mean drop over seeds; ``--he`` runs every attack with HE model
updates, ``--markdown`` prints the tables of suites' JSON files and the line of all their runs).
Settings (:func:`attack_config`): ``attack`` is the suite's (SynthCXR, iid, 32
px, 300 images per site, compact DenseNet, 10 local Adam steps of batch 16), ``smoke`` the smoke
profile's (28 px, 60 images per site, 2 local steps).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from fedweigh.arrays import Params, to_numpy_dict
from fedweigh.bench.config import SAFEGUARDS, BenchConfig, bench_safeguards, cell_args, make_config
from fedweigh.bench.federations import declared_sizes, federation_for
from fedweigh.bench.he_sites import EncryptedInProcessSites, HEKeys
from fedweigh.bench.modes import run_federated
from fedweigh.bench.sites import InProcessSites, LocalSites, SitePool
from fedweigh.data.base import Federation, SiteData
from fedweigh.data.scenarios import Scenario
from fedweigh.io import atomic_write_text
from fedweigh.metrics import evaluate_scores
from fedweigh.protocol import ABSOLUTE_MIN, META_NUM_SAMPLES, META_NUM_STEPS
from fedweigh.server.loop import TrainTask
from fedweigh.server.records import RoundRecorder
from fedweigh.server.rounds import ClientResult
from fedweigh.server.safeguards import Safeguards
from fedweigh.server.validation import ResultLimits

__all__ = [
    "ATTACKS",
    "CANDIDATES",
    "HE_SUITE",
    "combined_line",
    "front_table",
    "SETTINGS",
    "SUITE",
    "Attack",
    "AttackRecord",
    "RoundView",
    "TamperingSites",
    "attack_config",
    "attacker_sites",
    "main",
    "make_attack",
    "run_attack",
    "run_suite",
    "markdown_table",
    "settings_line",
    "summarise",
    "summary_line",
]

#: Reported sample counts of ``forged-count``: this many times the true one.
FORGED_COUNT = 1000
#: ``classifier-flip``: the classifier's arrays at this many times the norm of the attacker's own
#: update of the array (just inside a norm bound of 3 x the median of the other sites', the default
#: before bounded influence).
CLASSIFIER_FACTOR = 2.9
#: ``min-max`` / ``min-sum``: at most this many tries of the search for gamma (from gamma_init 10 to
#: tau 1e-5 it takes about 20).
MAX_SEARCH_STEPS = 200
#: ``model-replacement``: the boost of the update trained on flipped labels.
BOOST = 4.0


# ------------------------------------------------------------------------------------------- vectors
def float_keys(params: Mapping[str, Any]) -> list[str]:
    """The names of the floating-point arrays of ``params``, in order (what an update attack alters)."""
    return [k for k, v in params.items() if np.asarray(v).dtype.kind == "f"]


def flat_update(params: Mapping[str, Any], g: Mapping[str, Any], keys: Sequence[str]) -> np.ndarray:
    """Delta = theta - theta_g over ``keys``, flattened in that order (float64)."""
    return np.concatenate(
        [(np.asarray(params[k], np.float64) - np.asarray(g[k], np.float64)).ravel() for k in keys]
    )


def with_update(
    result: ClientResult, g: Mapping[str, Any], delta: np.ndarray, keys: Sequence[str]
) -> ClientResult:
    """``result`` sending theta_g + ``delta`` on ``keys`` (each array in the dtype the site sent);
    the other arrays as the site sent them."""
    params = dict(result.params or {})
    start = 0
    for k in keys:
        base = np.asarray(g[k], np.float64)
        part = np.asarray(delta[start : start + base.size], np.float64).reshape(base.shape)
        params[k] = (base + part).astype(np.asarray(params[k]).dtype)
        start += base.size
    if start != delta.size:
        raise ValueError(f"an update of {delta.size} values for arrays of {start} values")
    return replace(result, params=params)


@dataclass(frozen=True)
class RoundView:
    """What a full-knowledge attacker knows in round t: the global model theta_g^{t-1} it was sent and
    the honest sites' results of the round (their updates stacked by :meth:`honest_updates`)."""

    round_index: int
    global_params: Params
    honest: tuple[ClientResult, ...]

    def honest_updates(self, keys: Sequence[str]) -> np.ndarray:
        """The honest sites' updates over ``keys``, one row each (n, d); ValueError under 2 of them
        (the attacks that read the honest updates need their spread)."""
        if len(self.honest) < 2:
            raise ValueError(
                f"round {self.round_index}: {len(self.honest)} honest result(s); the attack needs at least 2"
            )
        return np.stack([flat_update(r.params or {}, self.global_params, keys) for r in self.honest])


# ------------------------------------------------------------------------------------------- attacks
class Attack(ABC):
    """One attack: what an attacking site sends instead of its honest result.

    ``flips_labels``: the attacking sites train on flipped labels before :meth:`tamper` sees their result.
    """

    name: str = ""
    flips_labels: bool = False

    @abstractmethod
    def tamper(self, result: ClientResult, view: RoundView, rng: np.random.Generator) -> ClientResult:
        """The attacker's result after the attack (``result``: its result after training)."""


class ByzflAttack(Attack):
    """An attack of ByzFL (``byzfl.attacks``) on the honest sites' updates: the attacker sends
    theta_g + attack(honest updates). ByzFL's random attacks draw from NumPy's global generator; it is
    seeded from ``rng`` for the call and restored afterwards."""

    def __init__(self, name: str, make: Callable[[Any], Any]):
        self.name = name
        self._make = make

    def tamper(self, result: ClientResult, view: RoundView, rng: np.random.Generator) -> ClientResult:
        import byzfl

        keys = float_keys(view.global_params)
        honest = view.honest_updates(keys)
        state = np.random.get_state()
        np.random.seed(int(rng.integers(2**32 - 1)))
        try:
            delta = np.asarray(self._make(byzfl)(honest), np.float64)
        finally:
            np.random.set_state(state)
        return with_update(result, view.global_params, delta, keys)


class LabelFlip(Attack):
    """Trained on flipped labels (:func:`flipped_site`); the update is sent as trained."""

    name = "labelflip"
    flips_labels = True

    def tamper(self, result: ClientResult, view: RoundView, rng: np.random.Generator) -> ClientResult:
        return result


class ModelReplacement(Attack):
    """Trained on flipped labels, the update boosted: theta_g + boost * Delta (Bagdasaryan et al. 2020)."""

    name = "model-replacement"
    flips_labels = True

    def __init__(self, boost: float = BOOST):
        self.boost = float(boost)

    def tamper(self, result: ClientResult, view: RoundView, rng: np.random.Generator) -> ClientResult:
        keys = float_keys(view.global_params)
        delta = flat_update(result.params or {}, view.global_params, keys)
        return with_update(result, view.global_params, self.boost * delta, keys)


class MinMaxSum(Attack):
    """Min-max / min-sum (Shejwalkar & Houmansadr, NDSS 2021, Algorithm 1): m = mu + gamma * p with
    mu the honest updates' mean, p = -std (coordinate-wise, ddof 1) or -mu / ||mu|| or -sign(mu),
    and gamma the largest the paper's halving search finds (gamma tried from gamma_init = 10, moved up
    after a fit and down otherwise, by 5 and then by half the previous move, until the last fit and
    the try differ by at most tau = 1e-5; 0 when none fits) such that

    - min-max: max_i ||m - Delta_i|| <= max_{i,j} ||Delta_i - Delta_j||;
    - min-sum: sum_i ||m - Delta_i||^2 <= max_i sum_j ||Delta_i - Delta_j||^2.
    """

    def __init__(
        self, objective: str, perturbation: str = "std", gamma_init: float = 10.0, tau: float = 1e-5
    ):
        if objective not in ("min-max", "min-sum"):
            raise ValueError(f"objective must be 'min-max' or 'min-sum', got {objective!r}")
        if perturbation not in ("std", "unit", "sign"):
            raise ValueError(f"perturbation must be 'std', 'unit' or 'sign', got {perturbation!r}")
        self.name = objective
        self.perturbation = perturbation
        self.gamma_init = float(gamma_init)
        self.tau = float(tau)

    def vector(self, honest: np.ndarray) -> np.ndarray:
        """The malicious update for the honest updates ``honest`` (n, d)."""
        mu = honest.mean(axis=0)
        if self.perturbation == "std":
            p = -honest.std(axis=0, ddof=1)
        elif self.perturbation == "unit":
            p = -mu / max(float(np.linalg.norm(mu)), 1e-30)
        else:
            p = -np.sign(mu)
        pairwise = np.linalg.norm(honest[:, None, :] - honest[None, :, :], axis=2)
        if self.name == "min-max":
            limit = float(pairwise.max())

            def fits(m: np.ndarray) -> bool:
                return float(np.linalg.norm(honest - m, axis=1).max()) <= limit
        else:
            limit = float((pairwise**2).sum(axis=1).max())

            def fits(m: np.ndarray) -> bool:
                return float((np.linalg.norm(honest - m, axis=1) ** 2).sum()) <= limit

        gamma, step, found = self.gamma_init, self.gamma_init, 0.0
        for _ in range(MAX_SEARCH_STEPS):
            if abs(found - gamma) <= self.tau:
                break
            if fits(mu + gamma * p):
                found = gamma
                gamma += step / 2
            else:
                gamma -= step / 2
            step /= 2
        return mu + found * p

    def tamper(self, result: ClientResult, view: RoundView, rng: np.random.Generator) -> ClientResult:
        keys = float_keys(view.global_params)
        return with_update(result, view.global_params, self.vector(view.honest_updates(keys)), keys)


def classifier_keys(params: Mapping[str, Any]) -> list[str]:
    """The classifier's arrays: those named ``class_layers`` (MONAI's DenseNet), else the last 2-D
    floating-point array and the bias beside it."""
    keys = float_keys(params)
    named = [k for k in keys if "class_layers" in k]
    if named:
        return named
    matrices = [k for k in keys if np.ndim(params[k]) == 2]
    if not matrices:
        raise ValueError("the model has no 2-D array to take for its classifier")
    last = matrices[-1]
    bias = last.rsplit(".", 1)[0] + ".bias"
    return [last, *([bias] if bias in keys else [])]


class ClassifierFlip(Attack):
    """The classifier's arrays of the attacker's own update negated at ``factor`` x its norm (per
    array): theta_g - factor * Delta; the other arrays as trained."""

    name = "classifier-flip"

    def __init__(self, factor: float = CLASSIFIER_FACTOR):
        self.factor = float(factor)

    def tamper(self, result: ClientResult, view: RoundView, rng: np.random.Generator) -> ClientResult:
        keys = classifier_keys(view.global_params)
        delta = flat_update(result.params or {}, view.global_params, keys)
        return with_update(result, view.global_params, -self.factor * delta, keys)


class ForgedCount(Attack):
    """The reported sample count N_k times ``factor`` (what size-driven weights read)."""

    name = "forged-count"

    def __init__(self, factor: int = FORGED_COUNT):
        self.factor = int(factor)

    def tamper(self, result: ClientResult, view: RoundView, rng: np.random.Generator) -> ClientResult:
        meta = dict(result.meta or {})
        meta[META_NUM_SAMPLES] = self.factor * int(meta[META_NUM_SAMPLES])
        return replace(result, meta=meta)


class ForgedSteps(Attack):
    """The reported local step count tau_k set to ``steps`` (what FedNova's weights read)."""

    name = "forged-steps"

    def __init__(self, steps: int = 1):
        self.steps = int(steps)

    def tamper(self, result: ClientResult, view: RoundView, rng: np.random.Generator) -> ClientResult:
        return replace(result, meta={**dict(result.meta or {}), META_NUM_STEPS: self.steps})


class Malformed(Attack):
    """A result every site's own checks should refuse (the round step leaves it out): ``nan`` / ``inf``
    in the first floating-point array, that array as ``complex64`` (``wrong-dtype``) or one row short
    (``wrong-shape``), every value theta_g + 1e30 (``huge``), or the site's result of the previous round
    sent again (``replay``)."""

    KINDS = ("nan", "inf", "wrong-dtype", "wrong-shape", "huge", "replay")

    def __init__(self, kind: str):
        if kind not in self.KINDS:
            raise ValueError(f"kind must be one of {', '.join(self.KINDS)}, got {kind!r}")
        self.name = kind
        self._last: dict[str, ClientResult] = {}

    def tamper(self, result: ClientResult, view: RoundView, rng: np.random.Generator) -> ClientResult:
        params = dict(result.params or {})
        first = float_keys(view.global_params)[0]
        if self.name == "replay":
            earlier = self._last.get(result.site)
            self._last.setdefault(result.site, result)
            return earlier if earlier is not None else result
        if self.name in ("nan", "inf"):
            bad = np.array(params[first], dtype=np.float32, copy=True)
            bad.reshape(-1)[0] = np.nan if self.name == "nan" else np.inf
            params[first] = bad
        elif self.name == "wrong-dtype":
            params[first] = np.asarray(params[first]).astype(np.complex64)
        elif self.name == "wrong-shape":
            params[first] = np.asarray(params[first])[:-1]
        else:  # huge
            keys = float_keys(view.global_params)
            return with_update(
                result,
                view.global_params,
                np.full(sum(np.size(view.global_params[k]) for k in keys), 1e30),
                keys,
            )
        return replace(result, params=params)


class HEShift(Attack):
    """Under HE: ``shift`` added to every value of the attacker's update before it encrypts it (the
    sites' guard is the only check that sees the sum)."""

    def __init__(self, shift: float):
        self.shift = float(shift)
        self.name = f"he-add-{shift:g}"

    def tamper(self, result: ClientResult, view: RoundView, rng: np.random.Generator) -> ClientResult:
        keys = float_keys(view.global_params)
        delta = flat_update(result.params or {}, view.global_params, keys)
        return with_update(result, view.global_params, delta + self.shift, keys)


class HECheckSlot(Attack):
    """Under HE: the attacker's check slot forged (5 instead of 1; the encrypted transport reads
    ``check_slot``); its update as trained."""

    name = "he-check-slot"
    check_slot = 5.0

    def tamper(self, result: ClientResult, view: RoundView, rng: np.random.Generator) -> ClientResult:
        return result


class Combined(Attack):
    """Several attacks in turn (``a+b``): trained on flipped labels when any of them is."""

    def __init__(self, parts: Sequence[Attack]):
        self.parts = list(parts)
        self.name = "+".join(p.name for p in self.parts)
        self.flips_labels = any(p.flips_labels for p in self.parts)
        self.check_slot = max(float(getattr(p, "check_slot", 1.0)) for p in self.parts)

    def tamper(self, result: ClientResult, view: RoundView, rng: np.random.Generator) -> ClientResult:
        for part in self.parts:
            result = part.tamper(result, view, rng)
        return result


#: name -> a new attack with its default parameters.
ATTACKS: dict[str, Callable[[], Attack]] = {
    "alie": lambda: ByzflAttack("alie", lambda b: b.ALittleIsEnough(tau=1.5)),
    "ipm": lambda: ByzflAttack("ipm", lambda b: b.InnerProductManipulation(tau=2.0)),
    "signflip": lambda: ByzflAttack("signflip", lambda b: b.SignFlipping()),
    "gaussian": lambda: ByzflAttack("gaussian", lambda b: b.Gaussian(mu=0.0, sigma=1.0)),
    "labelflip": LabelFlip,
    "model-replacement": ModelReplacement,
    "min-max": lambda: MinMaxSum("min-max"),
    "min-sum": lambda: MinMaxSum("min-sum"),
    "classifier-flip": ClassifierFlip,
    "forged-count": ForgedCount,
    "forged-steps": ForgedSteps,
    **{kind: (lambda kind=kind: Malformed(kind)) for kind in Malformed.KINDS},
    "he-add-0.1": lambda: HEShift(0.1),
    "he-add-1": lambda: HEShift(1.0),
    "he-check-slot": HECheckSlot,
}

#: The attacks that need HE (refused in plaintext runs).
HE_ONLY = ("he-add-0.1", "he-add-1", "he-check-slot")

#: The suite's attacks: (attack, the weighting scheme it runs against).
SUITE: tuple[tuple[str, str], ...] = (
    ("alie", "fedavg"),
    ("ipm", "fedavg"),
    ("signflip", "fedavg"),
    ("gaussian", "fedavg"),
    ("labelflip", "fedavg"),
    ("model-replacement", "fedavg"),
    ("model-replacement", "feddraw"),
    ("min-max", "fedavg"),
    ("min-sum", "fedavg"),
    ("classifier-flip", "fedavg"),
    ("labelflip+forged-count", "fedavg"),
    ("labelflip+forged-steps", "fednova"),
)


#: The suite's attacks under HE: those on FedAvg (the schemes that need plaintext updates, FedDRAW's
#: similarity among them, are refused under HE; FedNova's steps travel in clear as in plaintext).
HE_SUITE: tuple[tuple[str, str], ...] = tuple((a, s) for a, s in SUITE if s == "fedavg")


def make_attack(spec: str | Attack) -> Attack:
    """The attack ``spec`` names (:data:`ATTACKS`; ``a+b`` for several in turn)."""
    if isinstance(spec, Attack):
        return spec
    names = [s.strip() for s in str(spec).split("+")]
    unknown = [n for n in names if n not in ATTACKS]
    if unknown or not names:
        raise ValueError(f"unknown attack(s) {unknown} in {spec!r}; known: {', '.join(ATTACKS)}")
    parts = [ATTACKS[n]() for n in names]
    return parts[0] if len(parts) == 1 else Combined(parts)


def flipped_site(site: SiteData) -> SiteData:
    """``site`` with every training label flipped: multi-label 1 - y, multi-class C - 1 - y."""
    train = site.train
    if train.task == "multilabel":
        labels = (1.0 - train.labels).astype(train.labels.dtype)
    else:
        labels = (train.num_classes - 1 - train.labels).astype(train.labels.dtype)
    return replace(site, train=replace(train, labels=labels))


# ------------------------------------------------------------------------------------------- transport
class TamperingSites(InProcessSites):
    """The benchmark's in-process transport whose attacking sites alter their results.

    :meth:`train` collects every target's honest result as :class:`InProcessSites` does (the
    attackers' trainers may hold flipped labels), then passes each attacker's result through
    ``attack`` with the round's honest results in view; what the round loop receives goes on to the
    server's round step like any site's. ``sent`` keeps, per round, what each attacker sent.
    """

    def __init__(
        self,
        sites: LocalSites | SitePool,
        score: Callable[[Params], dict[str, float]],
        attack: Attack,
        attackers: Sequence[str],
        seed: int = 0,
    ):
        super().__init__(sites, score)
        self.attack = attack
        self.attackers = tuple(attackers)
        self.seed = int(seed)
        self.sent: dict[int, dict[str, ClientResult]] = {}

    def train(self, task: TrainTask) -> list[ClientResult]:
        return self.tamper(task, super().train(task))

    def tamper(self, task: TrainTask, results: Sequence[ClientResult]) -> list[ClientResult]:
        """``results`` with each attacker's altered by the attack (plaintext tasks)."""
        return tamper_results(self, task.round_index, to_numpy_dict(task.params), results)


def tamper_results(
    sites: TamperingSites | EncryptedTamperingSites, t: int, g: Params, results: Sequence[ClientResult]
) -> list[ClientResult]:
    """Round ``t``'s results with each of ``sites.attackers``' altered by ``sites.attack``, the honest
    results and the global model ``g`` the sites trained from in view; kept in ``sites.sent``."""
    view = RoundView(t, g, tuple(r for r in results if r.site not in sites.attackers))
    out = []
    for r in results:
        if r.site in sites.attackers:
            rng = np.random.default_rng([sites.seed, t, sites.attackers.index(r.site)])
            r = sites.attack.tamper(r, view, rng)
            sites.sent.setdefault(t, {})[r.site] = r
        out.append(r)
    return out


class EncryptedTamperingSites(EncryptedInProcessSites):
    """:class:`TamperingSites` under HE: the attackers alter their plaintext results (the honest ones
    in view) and encrypt them without the guard's clipping; the honest sites run as the NVFlare client
    does (:class:`~fedweigh.bench.he_sites.EncryptedInProcessSites`)."""

    def __init__(
        self,
        sites: LocalSites,
        score: Callable[[Params], dict[str, float]],
        keys: HEKeys,
        attack: Attack,
        attackers: Sequence[str],
        seed: int = 0,
        min_secure_sum: int = ABSOLUTE_MIN,
    ):
        super().__init__(sites, score, keys, min_secure_sum)
        self.attack = attack
        self.attackers = tuple(attackers)
        self.seed = int(seed)
        self.sent: dict[int, dict[str, ClientResult]] = {}

    def alter(self, task, results, receipts):
        g = to_numpy_dict(receipts[results[0].site].receipt.received)
        return tamper_results(self, task.round_index, g, results), set(self.attackers)

    def check_slot(self, site: str) -> float:
        return float(getattr(self.attack, "check_slot", 1.0)) if site in self.attackers else 1.0


# ------------------------------------------------------------------------------------------- runs
#: Client settings of the runs (:func:`attack_config`): profile, images per site, overrides.
SETTINGS: dict[str, dict[str, Any]] = {
    "attack": {"profile": "smoke", "per_site": 300, "size": 32, "max_steps": 10, "batch_size": 16},
    "smoke": {"profile": "smoke", "per_site": 60},
}


def _nnm_f(k: int) -> int:
    """The f of nearest-neighbour mixing for K sites: ceil(K / 4) (1 of 4, 2 of 8)."""
    return max(1, -(-k // 4))


#: Candidate defaults measured against the suite (name -> the server's safeguards for a federation):
#: the bench's presets with and without the consortium's declaration of sizes, and the defaults with a
#: robust option on top (nearest-neighbour mixing, the weighted median, the per-array direction check).
CANDIDATES: dict[str, Callable[[Federation], Safeguards]] = {
    # the safeguards off, and the norm bound of before bounded influence (3 x the others' reference
    # norm), step counts within 100 x only, sizes as reported
    "off": lambda fed: SAFEGUARDS["off"],
    "before": lambda fed: Safeguards(update_norm_bound=3.0, limits=ResultLimits(min_step_ratio=None)),
    # the defaults (norm bound 1 x the others' reference norm, the step floor), sizes as reported
    "undeclared": lambda fed: SAFEGUARDS["deploy"],
    # the defaults with the consortium's declaration of sizes: the default as deployed
    "deploy": lambda fed: replace(SAFEGUARDS["deploy"], declared_sizes=declared_sizes(fed)),
    # the defaults with a robust option on top
    "deploy-median": lambda fed: replace(
        SAFEGUARDS["deploy"], declared_sizes=declared_sizes(fed), aggregator="median"
    ),
    "deploy-arraycos": lambda fed: replace(
        SAFEGUARDS["deploy"], declared_sizes=declared_sizes(fed), array_cosine=0.0
    ),
    "deploy-nnm": lambda fed: replace(
        SAFEGUARDS["deploy"], declared_sizes=declared_sizes(fed), nnm_f=_nnm_f(len(fed.sites))
    ),
    "deploy-nnm-trimmed": lambda fed: replace(
        SAFEGUARDS["deploy"],
        declared_sizes=declared_sizes(fed),
        nnm_f=_nnm_f(len(fed.sites)),
        aggregator="trimmed_mean",
        trim=0.25,
    ),
}


def _iid(k: int) -> Scenario:
    return Scenario(name=f"iid-{k}", description=f"IID split over {k} sites", num_sites=k, partition="iid")


def attack_config(
    sites: int = 4,
    scheme: str = "fedavg",
    safeguards: str = "deploy",
    rounds: int = 10,
    seed: int = 0,
    settings: str = "attack",
    site_workers: int = 1,
) -> BenchConfig:
    """The bench configuration of one run: ``scheme`` on an iid split over ``sites`` sites
    (``iid-{sites}``), the server's ``safeguards`` preset (:data:`fedweigh.bench.config.SAFEGUARDS`),
    the client ``settings`` of :data:`SETTINGS`, scored after round 1 and the last round."""
    if settings not in SETTINGS:
        raise ValueError(f"settings must be one of {', '.join(SETTINGS)}, got {settings!r}")
    if safeguards not in CANDIDATES:
        raise ValueError(f"safeguards must be one of {', '.join(CANDIDATES)}, got {safeguards!r}")
    if sites < 3:
        raise ValueError(f"sites must be at least 3 (an attacker and two honest sites), got {sites}")
    options = dict(SETTINGS[settings])
    profile, per_site = options.pop("profile"), options.pop("per_site")
    config = make_config(
        profile,
        methods=[scheme],
        scenarios=["iid-4"],
        seeds=[seed],
        rounds=rounds,
        eval_every=rounds,
        site_workers=site_workers,
        safeguards=bench_safeguards(safeguards if safeguards in SAFEGUARDS else "deploy"),
        num_images=per_site * sites,
        **options,
    )
    return replace(config, scenarios=(f"iid-{sites}",), scenario_defs=(_iid(sites),))


def attacker_sites(names: Sequence[str], count: int) -> list[str]:
    """The ``count`` attacking sites: the last ones in name order (site-4 of four; site-7 and site-8 of eight)."""
    if not 1 <= count <= len(names) / 2 or len(names) - count < 2:
        raise ValueError(
            f"{count} attacker(s) of {len(names)} sites: need at least one, at most half of the sites, "
            "and two honest sites"
        )
    return sorted(names, key=lambda n: (len(n), n))[-count:]


@dataclass
class AttackRecord:
    """One run: the attack, who attacked, the setting, what the safeguards did and the AUC drop.

    ``left_out``: per training round (as a string key), the sites the round step left out;
    ``refused`` (HE): per round, the sites that refused the global model they decrypted (``-1``: the
    final model);
    ``drop``: clean AUC - AUC of the final global model on the test set (NaN when either is missing).
    """

    attack: str
    attackers: list[str]
    sites: int
    scheme: str
    safeguards: str
    rounds: int
    seed: int
    settings: str
    he: bool = False
    crashed: bool = False
    stalled: list[int] = field(default_factory=list)
    left_out: dict[str, list[str]] = field(default_factory=dict)
    bounded: dict[str, list[str]] = field(default_factory=dict)
    attacker_max_weight: float = 0.0
    refused: dict[str, list[str]] = field(default_factory=dict)
    auc: float = float("nan")
    clean_auc: float = float("nan")
    drop: float = float("nan")
    error: str = ""
    seconds: float = 0.0

    @property
    def crashed_or_stalled(self) -> bool:
        return self.crashed or bool(self.stalled)

    def as_dict(self) -> dict:
        return {**asdict(self), "crashed_or_stalled": self.crashed_or_stalled}


def _federation(
    config: BenchConfig, seed: int, attackers: Sequence[str], attack: Attack | None
) -> Federation:
    fed = federation_for(config, config.scenarios[0], seed)
    if attack is None or not attack.flips_labels:
        return fed
    return replace(fed, sites=[flipped_site(s) if s.name in attackers else s for s in fed.sites])


def run_attack(
    attack: str | Attack | None,
    *,
    attackers: int = 1,
    sites: int = 4,
    scheme: str = "fedavg",
    safeguards: str = "deploy",
    rounds: int = 10,
    seed: int = 0,
    settings: str = "attack",
    clean_auc: float | None = None,
    site_workers: int = 1,
    recorder: RoundRecorder | None = None,
    on_transport: Callable[[InProcessSites], None] | None = None,
    he: bool = False,
) -> AttackRecord:
    """One run of ``attack`` by ``attackers`` of ``sites`` sites (None: the clean run) through
    :func:`~fedweigh.server.loop.run_rounds`: the bench's own federated run
    (:func:`fedweigh.bench.modes.run_federated`) with a transport that tampers with the attackers' results
    (:func:`attack_config` gives the settings).

    ``clean_auc``: the clean run's AUC (None: run it here). ``recorder``: where the rounds go
    (default: a new one in memory). ``on_transport``: called with the transport before the rounds
    (e.g. to read :attr:`TamperingSites.sent` afterwards). ``he``: the updates travel encrypted (the
    server's :class:`~fedweigh.server.encrypted.EncryptedGlobalModel`, the sites' guards,
    :class:`EncryptedTamperingSites`; the AUC is that of the model the first site holds). "Crashed": an
    exception escaped the server or the final model's AUC is not finite; "stalled": a training round
    left the model unchanged.
    """
    t0 = time.perf_counter()
    config = attack_config(sites, scheme, safeguards, rounds, seed, settings, site_workers)
    chosen = None if attack is None else make_attack(attack)
    if chosen is not None and not he and any(n in HE_ONLY for n in chosen.name.split("+")):
        raise ValueError(f"{chosen.name}: an attack on encrypted updates; run it with he=True")
    if chosen is not None and he and any(n in Malformed.KINDS for n in chosen.name.split("+")):
        raise ValueError(f"{chosen.name}: a malformed plaintext result; run it without HE")
    fed = federation_for(config, config.scenarios[0], seed)
    # the candidate says whether the federation declared its sizes (CANDIDATES)
    config = replace(config, safeguards=CANDIDATES[safeguards](fed), declare_sizes=False)
    names = attacker_sites([s.name for s in fed.sites], attackers) if chosen is not None else []
    record = AttackRecord(
        attack=chosen.name if chosen is not None else "none",
        attackers=names,
        sites=sites,
        scheme=scheme,
        safeguards=safeguards,
        rounds=rounds,
        seed=seed,
        settings=settings,
        he=he,
    )
    fed = _federation(config, seed, names, chosen)
    spec = config.spec(scheme)
    args = cell_args(config, config.scenarios[0], seed, spec)
    recorder = recorder if recorder is not None else RoundRecorder(None, scheme)

    keys = HEKeys() if he else None
    made_transports: list[InProcessSites] = []
    floor = config.safeguards.min_secure_sum

    def transport(trainers, metrics) -> InProcessSites:
        if keys is not None:
            made = (
                EncryptedInProcessSites(trainers, metrics, keys, floor)
                if chosen is None
                else EncryptedTamperingSites(trainers, metrics, keys, chosen, names, seed, floor)
            )
        elif chosen is None:
            made = InProcessSites(trainers, metrics)
        else:
            made = TamperingSites(trainers, metrics, chosen, names, seed)
        made_transports.append(made)
        if on_transport is not None:
            on_transport(made)
        return made

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="y_pred contains classes not in y_true")
            _, scores, _ = run_federated(
                spec, fed, args, config, recorder=recorder, transport=transport, he=keys
            )
            test = fed.test
            record.auc = float(evaluate_scores(test.task, test.labels, scores[0], test.class_names)["auc"])
    except Exception as e:  # an attack that escapes every check is a crash of the job
        record.crashed, record.error = True, f"{type(e).__name__}: {e}"
    for row in recorder.rows:
        t = int(row.get("round", 0))
        if t < 1 or "global_updated" not in row:
            continue
        if not row["global_updated"]:
            record.stalled.append(t)
        if row.get("excluded"):
            record.left_out[str(t)] = sorted(row["excluded"])
        if row.get("bounded"):
            record.bounded[str(t)] = sorted(row["bounded"])
        weights = row.get("weights") or {}
        record.attacker_max_weight = max(
            record.attacker_max_weight, float(sum(weights.get(s, 0.0) for s in names))
        )
    for made in made_transports:
        for t, sites_ in sorted(getattr(made, "refusals", {}).items()):
            record.refused[str(t)] = sorted(set(sites_))
    if not np.isfinite(record.auc):
        record.crashed = True
        record.error = record.error or "the final global model gives no finite test AUC"
    if chosen is not None:
        if clean_auc is None:
            clean = run_attack(
                None,
                sites=sites,
                scheme=scheme,
                safeguards=safeguards,
                rounds=rounds,
                seed=seed,
                settings=settings,
                site_workers=site_workers,
                he=he,
            )
            clean_auc = clean.auc
        record.clean_auc = float(clean_auc)
        record.drop = record.clean_auc - record.auc
    else:
        record.clean_auc, record.drop = record.auc, 0.0
    record.seconds = time.perf_counter() - t0
    return record


# ------------------------------------------------------------------------------------------- suite
def summarise(records: Sequence[AttackRecord]) -> dict:
    """Attack runs tried and crashed or stalled, and the worst AUC drop of each group: one attacker of
    4 sites, one of 8, two of 8 in plaintext, and one of 4 under HE (per attack and scheme the mean
    drop over its completed seeds, the worst of those; None where none completed; ``he`` "not run"
    when no run was under HE)."""

    def worst(k: int, n: int, he: bool = False) -> float | None:
        drops: dict[tuple[str, str], list[float]] = {}
        for r in records:
            if (
                r.he == he
                and r.sites == k
                and len(r.attackers) == n
                and not r.crashed
                and np.isfinite(r.drop)
            ):
                drops.setdefault((r.attack, r.scheme), []).append(r.drop)
        return round(max(float(np.mean(d)) for d in drops.values()), 4) if drops else None

    return {
        "tried": len(records),
        "crashed_or_stalled": sum(r.crashed_or_stalled for r in records),
        "worst_auc_drop_one_of_4": worst(4, 1),
        "worst_auc_drop_one_of_8": worst(8, 1),
        "worst_auc_drop_two_of_8": worst(8, 2),
        "worst_auc_drop_he": worst(4, 1, he=True),
        "he": "run" if any(r.he for r in records) else "not run",
    }


def summary_line(summary: Mapping[str, Any]) -> str:
    """``attacks: N tried, C crashed or stalled, worst AUC drop D (one of 4), D8 (one of 8), E (two of
    8), H (HE)`` (``n/a`` where no run of the group completed; H ``not run`` when no run was under HE)."""

    def show(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.4f}"

    he = "not run" if summary.get("he") == "not run" else show(summary.get("worst_auc_drop_he"))
    return (
        f"attacks: {summary['tried']} tried, {summary['crashed_or_stalled']} crashed or stalled, worst AUC drop "
        f"{show(summary['worst_auc_drop_one_of_4'])} (one of 4), {show(summary['worst_auc_drop_one_of_8'])} "
        f"(one of 8), {show(summary['worst_auc_drop_two_of_8'])} (two of 8), {he} (HE)"
    )


def run_suite(
    attacks: Sequence[tuple[str, str]] = SUITE,
    *,
    sites: Sequence[int] = (4, 8),
    colluders: Sequence[int] = (1, 2),
    seeds: Sequence[int] = (0, 1, 2),
    rounds: int = 10,
    safeguards: str = "deploy",
    settings: str = "attack",
    site_workers: int = 1,
    progress: Callable[[AttackRecord], None] | None = None,
    he: bool = False,
) -> list[AttackRecord]:
    """Every (attack, scheme) of ``attacks`` for every K in ``sites``, number of attackers in
    ``colluders`` (at most K / 2, leaving two honest sites) and seed; one clean run per (K, scheme, seed).
    ``he``: every run under HE."""
    clean: dict[tuple[int, str, int], float] = {}
    records = []
    for k in sites:
        for n in (n for n in colluders if 1 <= n <= k / 2 and k - n >= 2):
            for seed in seeds:
                for attack, scheme in attacks:
                    run = {
                        "sites": k,
                        "scheme": scheme,
                        "safeguards": safeguards,
                        "rounds": rounds,
                        "seed": seed,
                        "settings": settings,
                        "site_workers": site_workers,
                        "he": he,
                    }
                    if (k, scheme, seed) not in clean:
                        clean[(k, scheme, seed)] = run_attack(None, **run).auc
                    record = run_attack(attack, attackers=n, clean_auc=clean[(k, scheme, seed)], **run)
                    records.append(record)
                    if progress is not None:
                        progress(record)
    return records


#: The groups of a suite's table, in order: (K, attackers) -> column heading.
GROUPS: dict[tuple[int, int], str] = {
    (4, 1): "one of 4",
    (4, 2): "two of 4",
    (8, 1): "one of 8",
    (8, 2): "two of 8",
}


def settings_line(body: Mapping[str, Any]) -> str:
    """The settings a suite's JSON holds, in words: the heading of its table in docs/security.md."""
    st = body["settings"]
    return (
        f"Settings: {st['rounds']} rounds; K = {', '.join(map(str, st['sites']))} sites; "
        f"{' or '.join(map(str, st['colluders']))} attacking site(s); seeds {', '.join(map(str, st['seeds']))}; "
        f"safeguards `{st['safeguards']}`; SynthCXR iid, {st.get('size', 28)} px, {st['per_site']} images per "
        f"site, compact DenseNet, {st.get('max_steps', 2)} local steps of batch {st.get('batch_size', 16)} per round; "
        "the scheme of each row"
        + (
            "; model updates encrypted (HE), the AUC that of the model the first site holds."
            if st.get("he")
            else "."
        )
    )


def markdown_table(body: Mapping[str, Any]) -> str:
    """A suite's table: per attack and scheme, the AUC drop against the clean run of the same seed,
    as the mean over seeds and the worst seed, per group (K, attackers), then the largest weight the
    attackers held and the site-rounds the safeguards left them out; the settings line above it and
    the summary line below."""
    runs = [r for r in body["runs"] if not r.get("crashed_or_stalled")]
    rows: dict[tuple[str, str], dict[tuple[int, int], list[dict]]] = {}
    for r in body["runs"]:
        rows.setdefault((r["attack"], r["scheme"]), {}).setdefault(
            (r["sites"], len(r["attackers"])), []
        ).append(r)
    groups = [g for g in GROUPS if any(g in cells for cells in rows.values())]
    head = " | ".join(f"{GROUPS[g]}: mean (worst)" for g in groups)
    he = any(r.get("he") for r in body["runs"])
    lines = [
        settings_line(body),
        "",
        f"| attack | scheme | {head} | largest attackers' weight | attacker site-rounds left out |"
        + (" honest site-rounds refusing the global model |" if he else ""),
        "|---|---|" + "---|" * len(groups) + "---|---|" + ("---|" if he else ""),
    ]
    for (attack, scheme), cells in rows.items():
        shown = []
        for g in groups:
            done = [r["drop"] for r in cells.get(g, []) if r in runs and r["drop"] == r["drop"]]
            crashed = sum(bool(r.get("crashed_or_stalled")) for r in cells.get(g, []))
            text = f"{np.mean(done):+.4f} ({max(done):+.4f})" if done else "-"
            shown.append(text + (f", {crashed} crashed or stalled" if crashed else ""))
        every = [r for c in cells.values() for r in c]
        weight = max(r["attacker_max_weight"] for r in every)
        left = sum(
            sum(1 for names in r["left_out"].values() for n in names if n in r["attackers"]) for r in every
        )
        refused = ""
        if he:
            refused = " | " + str(
                sum(
                    sum(1 for n in names if n not in r["attackers"])
                    for r in every
                    for names in r["refused"].values()
                )
            )
        lines.append(f"| {attack} | {scheme} | {' | '.join(shown)} | {weight:.3f} | {left}{refused} |")
    lines += ["", summary_line(body["summary"])]
    return "\n".join(lines)


def combined_line(bodies: Sequence[Mapping[str, Any]]) -> str:
    """The suite's last line over every run of several suites' JSON files (e.g. plaintext and HE)."""
    fields = set(AttackRecord.__dataclass_fields__)
    records = [AttackRecord(**{k: v for k, v in r.items() if k in fields}) for b in bodies for r in b["runs"]]
    return summary_line(summarise(records))


def front_table(bodies: Mapping[str, Mapping[str, Any]], costs: Mapping[str, Any] | None = None) -> str:
    """docs/security.md's front: per candidate (``bodies``: name -> a suite's JSON), the worst mean AUC
    drop of one attacker of 4 and of two of 8 over the attacks it ran, the attack that gave each, the
    largest weight the attackers held, and its honest cost where ``costs`` (a honest-cost JSON of
    benchmarks/bench_safeguard_cost.py) holds the setting."""

    def worst(body: Mapping[str, Any], k: int, n: int) -> str:
        drops: dict[str, list[float]] = {}
        for r in body["runs"]:
            if r["sites"] == k and len(r["attackers"]) == n and not r["crashed"] and r["drop"] == r["drop"]:
                drops.setdefault(f"{r['attack']} ({r['scheme']})", []).append(r["drop"])
        if not drops:
            return "- | -"
        name, d = max(drops.items(), key=lambda kv: float(np.mean(kv[1])))
        return f"{float(np.mean(d)):+.4f} | {name}"

    lines = [
        "| candidate | worst drop, one of 4 | by | worst drop, two of 8 | by | largest attackers' weight "
        "| honest cost (t-interval over cells) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, body in bodies.items():
        weight = max((r["attacker_max_weight"] for r in body["runs"]), default=float("nan"))
        entry = ((costs or {}).get("settings") or {}).get(name) or {}
        c = entry.get("effect_cells")
        cost = f"{c['mean']:+.4f} [{c['ci_low']:+.4f}, {c['ci_high']:+.4f}]" if c else "not run"
        lines.append(f"| {name} | {worst(body, 4, 1)} | {worst(body, 8, 2)} | {weight:.3f} | {cost} |")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """The suite runner (module docstring); exit status 1 when a run crashed or stalled."""
    parser = argparse.ArgumentParser(
        prog="python -m fedweigh.bench.attacks", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=10, help="training rounds per run (default 10)")
    parser.add_argument("--seeds", type=_ints, default=[0, 1, 2], help="seeds, e.g. 0,1,2 (default)")
    parser.add_argument("--sites", type=_ints, default=[4, 8], help="federation sizes K, e.g. 4,8 (default)")
    parser.add_argument(
        "--colluders", type=_ints, default=[1, 2], help="attacking sites per run (default 1,2)"
    )
    parser.add_argument(
        "--attacks", default=None, help="comma-separated ATTACK[@SCHEME] (default: the suite, SUITE)"
    )
    parser.add_argument(
        "--safeguards", choices=tuple(CANDIDATES), default="deploy", help="the server's safeguards"
    )
    parser.add_argument("--settings", choices=tuple(SETTINGS), default="attack", help="client settings")
    parser.add_argument("--workers", type=int, default=1, help="processes the sites train in (default 1)")
    parser.add_argument("--out", default=None, help="JSON file of the runs and the summary")
    parser.add_argument(
        "--he", action="store_true", help="every run with HE model updates (default: plaintext)"
    )
    parser.add_argument(
        "--markdown",
        nargs="+",
        default=None,
        metavar="JSON",
        help="print the table of each suite's JSON file, then the line of all their runs together, and exit",
    )
    ns = parser.parse_args(argv)
    if ns.markdown:
        bodies = [json.loads(Path(path).read_text()) for path in ns.markdown]
        for body in bodies:
            print(markdown_table(body), end="\n\n")
        print(combined_line(bodies))
        return 0
    if ns.attacks:
        chosen = []
        for item in ns.attacks.split(","):
            attack, _, scheme = item.strip().partition("@")
            make_attack(attack)  # a clear error before any run
            chosen.append((attack, scheme or "fedavg"))
    else:
        chosen = list(HE_SUITE if ns.he else SUITE)
    t0 = time.perf_counter()
    records: list[AttackRecord] = []
    command = "python -m fedweigh.bench.attacks " + " ".join(sys.argv[1:] if argv is None else argv)

    def write(complete: bool) -> None:
        if ns.out:
            body = {
                "command": command,
                "complete": complete,
                "settings": {
                    "rounds": ns.rounds,
                    "seeds": ns.seeds,
                    "sites": ns.sites,
                    "colluders": ns.colluders,
                    "safeguards": ns.safeguards,
                    "he": ns.he,
                    "client": ns.settings,
                    **SETTINGS[ns.settings],
                },
                "runs": [r.as_dict() for r in records],
                "summary": summarise(records),
                "seconds": round(time.perf_counter() - t0, 1),
            }
            atomic_write_text(Path(ns.out), json.dumps(body, indent=1) + "\n")

    def progress(r: AttackRecord) -> None:
        records.append(r)
        write(False)
        print(
            f"{r.attack:<24} {r.scheme:<8} K={r.sites} attackers={len(r.attackers)} seed={r.seed} "
            f"{'CRASHED/STALLED' if r.crashed_or_stalled else 'ok':<15} weight={r.attacker_max_weight:.3f} "
            f"left out {sum(len(v) for v in r.left_out.values())} AUC {r.auc:.4f} (clean {r.clean_auc:.4f}, "
            f"drop {r.drop:+.4f}) {r.seconds:.0f} s {r.error[:200]}",
            flush=True,
        )

    run_suite(
        chosen,
        sites=ns.sites,
        colluders=ns.colluders,
        seeds=ns.seeds,
        rounds=ns.rounds,
        safeguards=ns.safeguards,
        settings=ns.settings,
        site_workers=ns.workers,
        progress=progress,
        he=ns.he,
    )
    write(True)
    summary = summarise(records)
    print(summary_line(summary))
    return 0 if summary["crashed_or_stalled"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
