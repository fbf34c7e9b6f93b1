"""One benchmark cell, in one of three modes: federated, centralized or local training.

A federated cell does what ``nvflare simulator`` does with the method's recipe, on the same code:
the sites are :class:`fedweigh.site.trainer.SiteTrainer` objects (the NVFlare client script drives the
same class) and the rounds are :func:`fedweigh.server.loop.run_rounds` (the
:class:`~fedweigh.flare.controller.FedweighController` runs the same loop), here with the in-process
transport :class:`fedweigh.bench.sites.InProcessSites`. Per round t = 1..T: sample sites, send
theta_g^{t-1} with the scheme's plan (a site evaluates it, trains on it and reports), check every
result as the controller does, record the mean of the sites' metrics on theta_g^{t-1} as row t - 1,
then weight and aggregate into theta_g^t. After round T every site evaluates theta_g^T (row T), as the
controller's final ``validate`` task.

One difference that changes no number: the global test set is scored once per round on theta_g^{t-1}
instead of once by every sampled site (each site would score the same model on the same images).
The references: ``centralized`` trains one model on all sites' data pooled, ``local`` trains each
site alone.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from fedweigh.bench.cells import cell_key, settings_hash
from fedweigh.bench.config import BenchConfig, cell_args
from fedweigh.bench.federations import declared_sizes, federation_for, pool_sites, without_test
from fedweigh.bench.he_sites import EncryptedInProcessSites, HEKeys
from fedweigh.bench.sites import InProcessSites, LocalSites, SitePool, make_sites
from fedweigh.data import primary_labels
from fedweigh.data.base import Federation, LabeledImages
from fedweigh.histograms import global_stats_of
from fedweigh.methods import MethodSpec
from fedweigh.metrics import population_weights, weighted_macro_auc, youden_thresholds
from fedweigh.server.loop import LoopSettings, Transport, run_rounds
from fedweigh.server.model_check import ModelProbe
from fedweigh.server.records import RoundRecorder
from fedweigh.server.rounds import PlaintextBackend, RoundStep, mean_metrics
from fedweigh.site.args import ClientArgs
from fedweigh.site.trainer import SiteTrainer, build_site_model
from fedweigh.train import evaluate, get_params, predict, set_params
from fedweigh.weighting.geometry import use_model_buffers

__all__ = [
    "TestScorer",
    "run_cell",
    "run_centralized",
    "run_federated",
    "run_local",
    "safeguard_audit",
    "site_outcomes",
]

logger = logging.getLogger("fedweigh.bench")


class TestScorer:
    """Scores parameter sets on the global test set with one model of the cells' architecture.

    threshold "youden": multi-label predictions use per-finding thresholds maximising Youden's J on
    ``val`` (the union of the sites' validation splits) for the model being scored.
    ``score_test=False`` (tuning cells): :meth:`metrics` returns nothing and the test set is never read.
    """

    __test__ = False  # not a pytest class

    def __init__(
        self,
        args: ClientArgs,
        test: LabeledImages,
        val: LabeledImages,
        threshold: str,
        score_test: bool = True,
    ):
        self.test = test
        self.val = val
        self.threshold = threshold
        self.score_test = score_test
        self.model = build_site_model(args, val)  # the shapes only: val and test have the same

    def initial_params(self) -> dict[str, np.ndarray]:
        """theta_g^0: the model built from the seed, as the NVFlare persistor builds FedweighNet(seed=...)."""
        return get_params(self.model)

    def _thresholds(self) -> float | np.ndarray:
        if self.threshold != "youden" or self.test.task != "multilabel":
            return 0.5
        return youden_thresholds(self.val.labels, predict(self.model, self.val))

    def metrics(self, params: dict[str, np.ndarray]) -> dict[str, float]:
        """``test_*`` metrics of ``params`` (the keys a site's evaluate() reports); {} without test scoring."""
        if not self.score_test:
            return {}
        set_params(self.model, params)
        return {
            f"test_{k}": v for k, v in evaluate(self.model, self.test, threshold=self._thresholds()).items()
        }

    def scores(self, params: dict[str, np.ndarray]) -> np.ndarray:
        if not self.score_test:
            return np.zeros((0, self.test.num_classes), dtype=np.float32)
        set_params(self.model, params)
        return predict(self.model, self.test)


def _realised_sites(fed: Federation) -> dict:
    """``{"realised_sites": {site: {images, mix}}}`` when the scenario allowed shortfalls, else {}."""
    got = {s.name: s.train.meta["realised"] for s in fed.sites if "realised" in s.train.meta}
    return {"realised_sites": got} if got else {}


def site_outcomes(fed: Federation, site_names: list[str], scores: np.ndarray) -> dict:
    """Each site's AUC on a test set drawn like its own population, and its size:
    ``{"site_auc": {site: AUC}, "site_images": {site: train + val rows}}``.

    A site's population is its label mix (shares of the primary-label groups of its train and val
    rows; groups defined once over all sites' rows and the test rows, :func:`primary_labels`) and,
    when the test set is mixed by site-domain (``test.domain``), its own domain's test rows. The
    test rows are weighted to that mix (:func:`fedweigh.metrics.population_weights`) and scored by
    :func:`~fedweigh.metrics.weighted_macro_auc` on the cell's final model(s): ``scores`` (S, N, C),
    S = 1, or one model per site (``local``: each site's own). No extra inference: K weighted AUCs.
    ``site_names``: the scenario's sites in order (``test.domain`` k is site k).
    """
    if not len(fed.test) or scores.shape[0] == 0:
        return {}
    labels = [np.asarray(s.train.labels) for s in fed.sites] + [np.asarray(s.val.labels) for s in fed.sites]
    test_labels = np.asarray(fed.test.labels)
    groups = primary_labels(np.concatenate([*labels, test_labels]), fed.test.task)
    width = int(groups.max()) + 1
    test_groups = groups[len(groups) - len(test_labels) :]
    own, start = [], 0
    for s in fed.sites:  # each site's train rows, then (below) its val rows, as concatenated above
        own.append([groups[start : start + len(s.train)]])
        start += len(s.train)
    for k, s in enumerate(fed.sites):
        own[k].append(groups[start : start + len(s.val)])
        start += len(s.val)
    out: dict[str, dict] = {"site_auc": {}, "site_images": {}}
    for k, s in enumerate(fed.sites):
        mix = np.bincount(np.concatenate(own[k]), minlength=width).astype(np.float64)
        rows = np.ones(len(test_labels), dtype=bool)
        if fed.test.domain is not None:
            rows = np.asarray(fed.test.domain) == site_names.index(s.name)
        model = scores[k] if scores.shape[0] == len(fed.sites) and scores.shape[0] > 1 else scores[0]
        try:
            w = population_weights(test_groups[rows], mix / mix.sum())
            auc = weighted_macro_auc(test_labels[rows], model[rows], w)
        except ValueError:  # no test row of any group the site holds
            auc = float("nan")
        out["site_auc"][s.name] = auc
        out["site_images"][s.name] = len(s.train) + len(s.val)
    return out


def run_federated(
    spec: MethodSpec,
    fed: Federation,
    args: ClientArgs,
    config: BenchConfig,
    score_test: bool = True,
    recorder: RoundRecorder | None = None,
    transport: Callable[[LocalSites | SitePool, Callable[[dict], dict]], Transport] | None = None,
    he: HEKeys | None = None,
) -> tuple[list[dict], np.ndarray, dict]:
    """A federated run in the controller's order (module docstring); (rows, final test scores (1, N, C),
    :func:`safeguard_audit`).

    ``recorder``: where the rounds are recorded (default: a new one in memory); it keeps the
    controller's bookkeeping (``excluded``, ``bounded``, ``global_updated``), which the returned
    rows leave out. ``transport``: builds the run's transport from the sites and the test scorer's
    metrics (default: :class:`~fedweigh.bench.sites.InProcessSites`, under HE
    :class:`~fedweigh.bench.he_sites.EncryptedInProcessSites`; the attack suite passes one that tampers
    with the attackers' results). ``he``: the job's key pair; the server's backend is then
    :class:`~fedweigh.server.encrypted.EncryptedGlobalModel` (it holds only the public context) and
    the final scores are those of the model the first site holds."""
    scheme = spec.make_scheme()
    scorer = TestScorer(args, fed.test, pool_sites(fed.sites).val, config.threshold, score_test)
    use_model_buffers(scheme, scorer.model)  # geometry over the model's parameters, as the sites' own
    initial = scorer.initial_params()
    if he is None:
        backend = PlaintextBackend(initial)
    else:
        from fedweigh.server.encrypted import EncryptedGlobalModel

        backend = EncryptedGlobalModel(he.public, initial)
    if transport is None:
        transport = (
            InProcessSites
            if he is None
            else (lambda sites, score: EncryptedInProcessSites(sites, score, he, guards.min_secure_sum))
        )
    guards = config.safeguards
    if config.declare_sizes and guards.declared_sizes is None:  # the consortium's declaration
        guards = replace(guards, declared_sizes=declared_sizes(fed))
    step = RoundStep(
        scheme,
        backend,
        num_rounds=config.rounds,
        safeguards=guards,
        probe=ModelProbe(scorer.model),  # the controller's probe: the persistor's model
        log=logger.warning,
    )
    sites = make_sites(fed.sites, fed.test, args, config.site_workers, config.site_policy())
    recorder = recorder if recorder is not None else RoundRecorder(None, str(spec.scheme))
    loop = LoopSettings(fed.sample_fraction, args.seed, eval_every=config.eval_every)
    try:
        if spec.needs_statistics():  # the statistics phase: sum_k v_k over all sites, decoded at each site
            # each site contributes what it may release (noised when statistics DP is on), as its client does
            releases = sites.released_statistics().values()
            sites.set_global_stats(global_stats_of((r.class_counts, r.num_samples) for r in releases))
        plan = step.plan(str(spec.scheme), spec.scheme_args)
        made = transport(sites, scorer.metrics)
        run_rounds(step, made, recorder, plan, loop, log=logger.info)
        final = backend.task_params()
        if he is not None:  # the server holds ciphertext: the model the first site holds
            final = made.held(final, backend.task_meta())
    finally:
        sites.close()
    return (
        _plain_rows(recorder.rows),
        scorer.scores(final)[None],
        safeguard_audit(recorder.rows),
    )


def safeguard_audit(rows: list[dict]) -> dict:
    """What the server's safeguards did in a run (the recorder's rows): site-rounds left out and
    bounded (scaled, clipped or arrays left out), and the training rounds that left the model unchanged."""
    trained = [r for r in rows if r.get("round", 0) >= 1 and "global_updated" in r]
    return {
        "site_rounds_left_out": sum(len(r.get("excluded", {})) for r in trained),
        "site_rounds_bounded": sum(len(r.get("bounded", {})) for r in trained),
        "rounds_unchanged": [r["round"] for r in trained if not r["global_updated"]],
    }


def _plain_rows(rows: list[dict]) -> list[dict]:
    """Rows as the benchmark stores them: without the controller's per-round bookkeeping keys."""
    return [
        {k: v for k, v in row.items() if k not in ("excluded", "global_updated", "bounded")} for row in rows
    ]


def run_centralized(
    fed: Federation, args: ClientArgs, config: BenchConfig, score_test: bool = True
) -> tuple[list[dict], np.ndarray]:
    """One trainer on all sites' data pooled, T rounds of the same local training as a site."""
    rounds = config.rounds
    pooled = pool_sites(fed.sites)
    trainer = SiteTrainer(pooled, fed.test, args, threads=args.threads or None)
    scorer = TestScorer(args, fed.test, pooled.val, config.threshold, score_test)
    params = scorer.initial_params()
    rows = RoundRecorder(None, "centralized")
    loop = LoopSettings(eval_every=config.eval_every)
    for t in range(1, rounds + 1):
        t0 = time.perf_counter()
        scored = loop.scored(t)
        out = trainer.run_round(params, t - 1, {}, total_rounds=rounds, evaluate_received=scored)
        rows.set_metrics(t - 1, {**out.metrics, **(scorer.metrics(params) if scored else {})})
        params = out.params
        rows.set_metrics(t, {"round_seconds": time.perf_counter() - t0})
    set_params(trainer.model, params)
    rows.set_metrics(rounds, {**trainer.evaluate(), **scorer.metrics(params)})
    return rows.rows, scorer.scores(params)[None]


def run_local(
    fed: Federation, args: ClientArgs, config: BenchConfig, score_test: bool = True
) -> tuple[list[dict], np.ndarray]:
    """Each site trains alone for T rounds. Rows hold the mean over sites of each site's own model:
    validation metrics every round, test metrics at round 0 (the shared theta^0) and round T only
    (scoring K models on the test set every round would cost more than the training)."""
    rounds = config.rounds
    trainers = {s.name: SiteTrainer(s, fed.test, args, threads=args.threads or None) for s in fed.sites}
    scorer = TestScorer(args, fed.test, pool_sites(fed.sites).val, config.threshold, score_test)
    initial = scorer.initial_params()
    params = {name: initial for name in trainers}
    rows = RoundRecorder(None, "local")
    rows.set_metrics(0, scorer.metrics(initial))
    loop = LoopSettings(eval_every=config.eval_every)
    for t in range(1, rounds + 1):
        t0 = time.perf_counter()
        val = []
        scored = loop.scored(t)
        for name, trainer in trainers.items():
            out = trainer.run_round(params[name], t - 1, {}, total_rounds=rounds, evaluate_received=scored)
            val.append(out.metrics)
            params[name] = out.params
        rows.set_metrics(t - 1, mean_metrics(val))
        rows.set_metrics(t, {"round_seconds": time.perf_counter() - t0})
    val, test = [], []
    for name, trainer in trainers.items():
        set_params(trainer.model, params[name])
        val.append(trainer.evaluate())
        test.append(scorer.metrics(params[name]))
    rows.set_metrics(rounds, {**mean_metrics(val), **mean_metrics(test)})
    return rows.rows, np.stack([scorer.scores(params[name]) for name in trainers])


def run_cell(
    config: BenchConfig, scenario: str, method: str, seed: int, validation_only: bool = False
) -> tuple[dict, np.ndarray, np.ndarray]:
    """Run one cell; returns (record, scores (S, N, C) of the final model(s) on the test set, test labels).

    The record holds ``rows`` in the controller's format: ``round`` (0 = initial model), the mean
    site metrics (``val_*``, ``train_loss``), the test metrics (``test_*``), and for training rounds
    ``weights`` and the scheme's schedule values. ``validation_only`` (tuning cells): the cell runs
    on the federation :func:`~fedweigh.bench.federations.without_test`, its rows hold no test metrics
    and the scores are empty.
    """
    spec = config.spec(method)
    args = cell_args(config, scenario, seed, spec)
    fed = federation_for(config, scenario, seed)
    if validation_only:
        fed = without_test(fed)
    score_test = not validation_only
    t0 = time.perf_counter()
    audit = None
    with warnings.catch_warnings():
        # a small site's validation split under label skew lacks classes: scikit-learn says so per call
        warnings.filterwarnings("ignore", message="y_pred contains classes not in y_true")
        if spec.kind == "federated":
            rows, scores, audit = run_federated(spec, fed, args, config, score_test)
        elif spec.kind == "centralized":
            rows, scores = run_centralized(fed, args, config, score_test)
        else:
            rows, scores = run_local(fed, args, config, score_test)
    record = {
        "key": cell_key(scenario, method, seed),
        "dataset": config.dataset,
        "scenario": scenario,
        "method": method,
        "seed": seed,
        "settings_hash": settings_hash(config, scenario, method, seed),
        **({"options": dict(config.tuned[method])} if config.tuned.get(method) else {}),
        "task": fed.test.task,
        "class_names": list(fed.test.class_names),
        "sites": [s.name for s in fed.sites],
        "rounds": config.rounds,
        "rows": rows,
        **(site_outcomes(fed, config.scenario(scenario).site_names, scores) if score_test else {}),
        **_realised_sites(fed),
        **({"safeguards": audit} if audit is not None else {}),
        "seconds": time.perf_counter() - t0,
    }
    return record, scores, np.asarray(fed.test.labels)
