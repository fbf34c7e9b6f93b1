"""The benchmark runner: scenario x method x seed cells, each a whole federated run in one process.

A federated cell does what ``nvflare simulator`` does with the method's recipe, on the same code:
the sites are :class:`fedweigh.site.trainer.SiteTrainer` objects (the NVFlare client script drives the same
class), and the server's side of each round is :class:`fedweigh.server.rounds.RoundStep` recorded by
:class:`fedweigh.server.records.RoundRecorder` (the :class:`~fedweigh.flare.controller.FedweighController`
calls the same step and recorder).
Per round t = 1..T: sample sites, send theta_g^{t-1} with the scheme's plan (a site evaluates it,
trains on it and reports), check every result as the controller does, record the mean of the sites'
metrics on theta_g^{t-1} as row t - 1, then weight and aggregate into theta_g^t. After round T
every site evaluates theta_g^T (row T), as the controller's final ``validate`` task.

One difference that changes no number: the global test set is scored once per round on theta_g^{t-1}
instead of once by every sampled site (each site would score the same model on the same images).

Cells are stored by :mod:`fedweigh.bench.cells`, so a rerun skips finished cells.

Tuning (``tune``, :class:`TuneSpec`): before the reported cells, every method with a grid runs each
grid point on a tuning cell (``tune_scenario``, ``tune_seed``: a seed no reported cell uses), with
the test set removed from its federation, and keeps the point with the best validation AUC (the
mean over the sites' validation splits of the final global model; centralized: the pooled
validation split). The reported cells then run with the chosen options; ``summary.json`` records
the grid, the validation AUCs and the choice under ``tuning``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import os
import time
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from fedweigh.bench.cells import CELLS_DIR, cell_key, load_cell, store_cell
from fedweigh.bench.profiles import THRESHOLDS, get_profile
from fedweigh.bench.report import SUMMARY_JSON, write_outputs
from fedweigh.bench.sites import make_sites
from fedweigh.checks import check_client_args, check_dataset_path
from fedweigh.data import DATASETS, build_federation
from fedweigh.data.base import Federation, LabeledImages, SiteData
from fedweigh.data.scenario_file import load_scenario_file
from fedweigh.data.scenarios import Scenario, get_scenario
from fedweigh.errors import BenchError, ConfigError
from fedweigh.histograms import global_stats_of
from fedweigh.io import atomic_write_text
from fedweigh.methods import CLIENT_OPTION_ALIASES, CLIENT_OPTIONS, MethodSpec, parse_method
from fedweigh.metrics import youden_thresholds
from fedweigh.protocol import META_NUM_SAMPLES, META_NUM_STEPS, META_SCALARS
from fedweigh.server.records import RoundRecorder
from fedweigh.server.rounds import (
    DEFAULT_MIN_UPDATE_COSINE,
    DEFAULT_UPDATE_NORM_BOUND,
    ClientResult,
    PlaintextBackend,
    RoundStep,
    check_max_share,
    check_min_update_cosine,
    check_update_norm_bound,
    mean_metrics,
    sample_sites,
)
from fedweigh.site.args import ClientArgs
from fedweigh.site.data_config import expand_data_path
from fedweigh.site.trainer import RoundOutput, SiteTrainer, build_site_model
from fedweigh.train import evaluate, get_params, predict, set_params
from fedweigh.weighting.geometry import use_model_buffers

logger = logging.getLogger("fedweigh.bench")

CONFIG_JSON = "config.json"
#: Where the tuning cells' records are kept (no test predictions: they never score the test set).
TUNING_DIR = "tuning"

#: ClientArgs fields that do not change a cell's numbers (left out of its settings hash).
_NOT_HASHED = ("threads", "eval_test", "compile")
#: Settings added after cells were stored: in the digest only when not at this default, so stored
#: cells stay valid.
_HASHED_WHEN_CHANGED: dict[str, object] = {
    "augment": False,
    "pretrained": None,
    "momentum": 0.9,
    "weight_decay": 0.0,
    "test_images": None,
}


@dataclass(frozen=True)
class TuneSpec:
    """One tuned option: ``key`` (as in a method label: ``lr``, ``loss.mu``, ``client_mu``, ...) over
    ``values``, for the methods whose name or label is ``method`` (None: every method)."""

    key: str
    values: tuple
    method: str | None = None

    def applies_to(self, label: str) -> bool:
        return self.method is None or self.method in (label, label.split(":", 1)[0])


def parse_tune(text: str) -> TuneSpec:
    """A :class:`TuneSpec` from ``[METHOD:]KEY=V1,V2,...`` (``lr=3e-4,1e-3``, ``fedprox:client_mu=0.01,0.1``).

    Without a method, a client option's key (``lr``, ``optim``, ...) means the client option for
    every method (``client.lr``), so that FedAWA's server ``lr`` is never tuned by accident.
    """
    head, sep, raw = text.partition("=")
    method, colon, key = head.rpartition(":")
    key = key.strip()
    if not sep or not key or not raw.strip():
        raise ValueError(f"--tune {text!r}: expected [METHOD:]KEY=V1,V2,... (e.g. lr=3e-4,1e-3,3e-3)")
    values = []
    for item in (v.strip() for v in raw.split(",")):
        if not item:
            raise ValueError(f"--tune {text!r}: an empty value in the grid")
        try:
            values.append(json.loads(item))
        except json.JSONDecodeError:
            values.append(item)
    if len(set(map(str, values))) != len(values):
        raise ValueError(f"--tune {text!r}: a value is listed twice")
    if not colon and "." not in key and key in (*CLIENT_OPTIONS, *CLIENT_OPTION_ALIASES):
        key = f"client.{key}"
    return TuneSpec(key=key, values=tuple(values), method=method.strip() or None)


#: The server's safeguards of a bench run (``--safeguards``): ``"off"`` (the default) runs the
#: weighting schemes exactly as their papers define them, so that a comparison measures the weighting
#: alone; ``"deploy"`` applies the NVFlare controller's defaults, to measure what a federation runs.
#: Off by default because, in converged runs, the direction check and the norm bound act on honest
#: sites: most often on the site whose data differ most from the others' (docs/bench.md).
SAFEGUARDS: dict[str, dict[str, object]] = {
    "off": {"max_share": None, "update_norm_bound": None, "min_update_cosine": None},
    "deploy": {
        "max_share": "auto",
        "update_norm_bound": DEFAULT_UPDATE_NORM_BOUND,
        "min_update_cosine": DEFAULT_MIN_UPDATE_COSINE,
    },
}
#: A safeguard argument of :func:`make_config` left to ``safeguards``.
FROM_SAFEGUARDS = object()


def find_scenario(defs: Sequence[Scenario], name: str) -> Scenario:
    """The scenario called ``name`` among ``defs`` (from files), else in the catalogue (KeyError)."""
    for sc in defs:
        if sc.name == name:
            return sc
    return get_scenario(name)


@dataclass(frozen=True)
class BenchConfig:
    """Everything that defines a benchmark's cells.

    client: the local-training settings shared by every cell (scenario and seed are set per cell).
    sites: restrict every scenario to these site names (e.g. the two sites a simulator run has).
    min_clients: fewest valid results for a round to update the global model (as the controller's).
    threshold: ``"0.5"`` or ``"youden"``, for the thresholded test metrics (see :class:`Profile`).
    eval_every: score the global model (sites' validation splits, the test set) every k rounds and
        after the last round (1: every round). Training is the same for every k.
    site_workers: processes a cell's sites train in, in parallel (1: in the cell's process); changes
        no number.
    max_share / update_norm_bound / min_update_cosine: the server's safeguards (docs/security.md);
        off (None) by default, so that the schemes run exactly as their papers define them;
        :data:`SAFEGUARDS` ``"deploy"`` gives the NVFlare controller's defaults.
    """

    dataset: str
    profile: str
    client: ClientArgs
    rounds: int
    methods: tuple[str, ...]
    scenarios: tuple[str, ...]
    seeds: tuple[int, ...]
    sites: tuple[str, ...] | None = None
    min_clients: int = 1
    threshold: str = "0.5"
    eval_every: int = 1
    site_workers: int = 1
    max_share: float | str | None = None
    update_norm_bound: float | None = None
    min_update_cosine: float | None = None
    #: options to tune per method before the reported cells, and where (scenario, seed)
    tune: tuple[TuneSpec, ...] = ()
    tune_scenario: str | None = None
    tune_seed: int | None = None
    #: label -> options the cells of that method run with (set by the tuning; keys as in labels)
    tuned: dict = field(default_factory=dict)
    #: scenarios defined in files (``--scenario-file``), run like catalogue ones under their names
    scenario_defs: tuple[Scenario, ...] = ()

    def scenario(self, name: str) -> Scenario:
        """The scenario called ``name``: one of ``scenario_defs``, else the catalogue's."""
        return find_scenario(self.scenario_defs, name)

    def spec(self, method: str) -> MethodSpec:
        """The :class:`MethodSpec` a cell of ``method`` runs: its label's, with the tuned options."""
        spec = parse_method(method)
        return spec.with_options(self.tuned[method]) if self.tuned.get(method) else spec

    def tune_grid(self, method: str) -> list[dict]:
        """The grid points (options dicts) tuned for ``method``: the product of its tuned options."""
        grid: list[dict] = [{}]
        for t in self.tune:
            if t.applies_to(method):
                grid = [{**point, t.key: v} for point in grid for v in t.values]
        return grid if len(grid) > 1 or grid[0] else []

    def cells(self) -> list[tuple[str, str, int]]:
        """(scenario, method, seed) of every cell, grouped so that each federation is built once."""
        return [(sc, m, s) for s in self.seeds for sc in self.scenarios for m in self.methods]

    def as_dict(self) -> dict:
        out = asdict(self)
        out["client"] = asdict(self.client)
        return out


def make_config(
    profile: str = "smoke",
    dataset: str = "synthcxr",
    *,
    data_path: str | None = None,
    methods: Sequence[str] | None = None,
    scenarios: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    sites: Sequence[str] | None = None,
    rounds: int | None = None,
    min_clients: int = 1,
    threshold: str | None = None,
    eval_every: int | None = None,
    site_workers: int = 1,
    safeguards: str = "off",
    max_share: float | str | None | object = FROM_SAFEGUARDS,
    update_norm_bound: float | None | object = FROM_SAFEGUARDS,
    min_update_cosine: float | None | object = FROM_SAFEGUARDS,
    tune: Sequence[str | TuneSpec] = (),
    tune_scenario: str | None = None,
    tune_seed: int | None = None,
    scenario_files: Sequence[str | Path] = (),
    **client_overrides: object,
) -> BenchConfig:
    """A :class:`BenchConfig` from a profile; every argument left None keeps the profile's value.

    ``client_overrides`` are :class:`ClientArgs` fields (``num_images``, ``max_steps``, ``size``, ...).
    ``tune``: options to tune per method (``[METHOD:]KEY=V1,V2``, :func:`parse_tune`) on
    ``tune_scenario`` (default: the first scenario) with ``tune_seed`` (default: one above the
    largest seed; never a reported seed). ``scenario_files``: scenarios defined in JSON / YAML files
    (:mod:`fedweigh.data.scenario_file`); they run after those named in ``scenarios`` (with none
    named, only the files' scenarios run).
    Raises ValueError naming the bad dataset, scenario, method, seed, round count or tuned option.
    """
    if safeguards not in SAFEGUARDS:
        raise ValueError(f"safeguards must be one of {', '.join(SAFEGUARDS)}, got {safeguards!r}")
    given = {
        "max_share": max_share,
        "update_norm_bound": update_norm_bound,
        "min_update_cosine": min_update_cosine,
    }
    guards = {k: SAFEGUARDS[safeguards][k] if v is FROM_SAFEGUARDS else v for k, v in given.items()}
    prof = get_profile(profile)
    threshold = prof.threshold if threshold is None else str(threshold)
    if threshold not in THRESHOLDS:
        raise ValueError(f"threshold must be one of {THRESHOLDS}, got {threshold!r}")
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; known: {', '.join(DATASETS)}")
    if data_path is not None and not Path(os.path.expandvars(str(data_path))).exists():
        raise ConfigError("bench", "--data", data_path, "no such file or folder")
    check_dataset_path("bench", dataset, data_path, field="--data")
    client = check_client_args(
        prof.client_args(dataset, data_path=data_path, **client_overrides), "bench client settings"
    )
    methods = tuple(methods or prof.default_methods())
    defs = tuple(load_scenario_file(f) for f in scenario_files)
    file_names = [d.name for d in defs]
    if len(set(file_names)) != len(file_names):
        raise ValueError(f"two scenario files define the same scenario name: {file_names}")
    if scenarios:
        scenarios = tuple(scenarios) + tuple(n for n in file_names if n not in scenarios)
    else:
        scenarios = tuple(file_names) or prof.default_scenarios()
    seeds = tuple(int(s) for s in (seeds if seeds is not None else prof.seeds))
    rounds = prof.rounds if rounds is None else int(rounds)
    eval_every = prof.eval_every if eval_every is None else int(eval_every)
    if eval_every < 1:
        raise ValueError(f"eval_every must be >= 1, got {eval_every}")
    if site_workers < 1:
        raise ValueError(f"site_workers must be >= 1, got {site_workers}")
    for label in methods:
        parse_method(label)
    for name in scenarios:
        find_scenario(defs, name)
    for dup, what in ((methods, "method"), (scenarios, "scenario"), (seeds, "seed")):
        if len(set(dup)) != len(dup):
            raise ValueError(f"a {what} is listed twice: {list(dup)}")
    if not methods or not scenarios or not seeds:
        raise ValueError("a benchmark needs at least one method, one scenario and one seed")
    if any(s < 0 for s in seeds):
        raise ValueError(f"seeds must be non-negative, got {list(seeds)}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if min_clients < 1:
        raise ValueError(f"min_clients must be >= 1, got {min_clients}")
    tunes = tuple(t if isinstance(t, TuneSpec) else parse_tune(t) for t in tune)
    if tunes:
        tune_scenario = tune_scenario or scenarios[0]
        find_scenario(defs, tune_scenario)
        tune_seed = max(seeds) + 1 if tune_seed is None else int(tune_seed)
        if tune_seed in seeds or tune_seed < 0:
            raise ValueError(
                f"--tune-seed {tune_seed} must be a non-negative seed no reported cell uses (seeds: {list(seeds)})"
            )
        for t in tunes:
            if t.method is not None and not any(t.applies_to(m) for m in methods):
                raise ValueError(f"--tune {t.method}:{t.key}: no method {t.method!r} among {list(methods)}")
    elif tune_scenario is not None or tune_seed is not None:
        raise ValueError("--tune-scenario and --tune-seed need --tune")
    config = BenchConfig(
        dataset=dataset,
        profile=profile,
        client=client,
        rounds=rounds,
        methods=methods,
        scenarios=scenarios,
        seeds=seeds,
        sites=tuple(sites) if sites else None,
        min_clients=min_clients,
        threshold=threshold,
        eval_every=eval_every,
        site_workers=site_workers,
        max_share=check_max_share(guards["max_share"]),
        update_norm_bound=check_update_norm_bound(guards["update_norm_bound"]),
        min_update_cosine=check_min_update_cosine(guards["min_update_cosine"]),
        tune=tunes,
        tune_scenario=tune_scenario if tunes else None,
        tune_seed=tune_seed if tunes else None,
        scenario_defs=defs,
    )
    for label in methods:  # every grid point is a valid method configuration (one-line errors)
        for point in config.tune_grid(label):
            cell_args(
                config, config.tune_scenario or scenarios[0], 0, parse_method(label).with_options(point)
            )
    return config


# ------------------------------------------------------------------------------------------- cells
def cell_args(config: BenchConfig, scenario: str, seed: int, spec: MethodSpec) -> ClientArgs:
    """The ClientArgs of one cell: the shared settings plus scenario, seed, the method's loss and the
    client options the method prescribes (they win over the shared settings)."""
    args = replace(config.client, dataset=config.dataset, seed=seed, eval_test=False)
    if spec.loss != "default" and args.loss == "default":  # the recipes' _client_with_loss rule
        args = replace(args, loss=spec.loss, loss_options=dict(spec.loss_options or args.loss_options))
    if spec.client_options:
        args = check_client_args(replace(args, **spec.client_options), f"method {spec.label!r}")
    return replace(args, scenario=scenario)  # set after the checks: a file's scenario is no catalogue name


def settings_hash(config: BenchConfig, scenario: str, method: str, seed: int) -> str:
    """A digest of everything that determines a cell's numbers (a stored cell is reused only if equal)."""
    spec = config.spec(method)
    args = {
        k: v
        for k, v in asdict(cell_args(config, scenario, seed, spec)).items()
        if k not in _NOT_HASHED and not (k in _HASHED_WHEN_CHANGED and v == _HASHED_WHEN_CHANGED[k])
    }
    payload = {
        "client": args,
        "rounds": config.rounds,
        "sites": list(config.sites) if config.sites else None,
        "min_clients": config.min_clients,
        "threshold": config.threshold,
        "eval_every": config.eval_every,
        "safeguards": [config.max_share, config.update_norm_bound, config.min_update_cosine],
        "method": spec.as_dict(),
    }
    if any(sc.name == scenario for sc in config.scenario_defs):  # a file's scenario: its definition
        payload["scenario"] = asdict(config.scenario(scenario))
    return hashlib.sha1(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def is_done(cells_dir: Path, config: BenchConfig, scenario: str, method: str, seed: int) -> bool:
    """Whether the cell is stored with the same settings (and its predictions file exists)."""
    key = cell_key(scenario, method, seed)
    record = load_cell(cells_dir, key)
    if record is None or not (cells_dir / f"{key}.npz").is_file():
        return False
    if record.get("settings_hash") != settings_hash(config, scenario, method, seed):
        logger.warning("%s: stored with other settings; running it again", key)
        return False
    return True


# -------------------------------------------------------------------------------------- federations
_FEDERATIONS: OrderedDict[tuple, Federation] = OrderedDict()
_FEDERATION_CACHE_SIZE = 2


def federation_for(config: BenchConfig, scenario: str, seed: int) -> Federation:
    """The scenario's federation (restricted to ``config.sites``), built once per process and key."""
    c = config.client
    key = (
        config.dataset,
        c.data_path,
        json.dumps(c.loader_options, sort_keys=True),
        scenario,
        c.size,
        seed,
        c.num_images,
        c.test_images,
        config.scenario(scenario),
        config.sites,
    )
    if key in _FEDERATIONS:
        _FEDERATIONS.move_to_end(key)
        return _FEDERATIONS[key]
    fed = build_federation(
        config.scenario(scenario),
        config.dataset,
        data_path=expand_data_path(c.data_path),
        size=c.size,
        seed=seed,
        num_images=c.num_images,
        loader_options=c.loader_options,
        test_images=c.test_images,
    )
    if config.sites:
        names = [s.name for s in fed.sites]
        unknown = [s for s in config.sites if s not in names]
        if unknown:
            raise ValueError(f"sites {unknown} are not in scenario {scenario!r} (sites: {', '.join(names)})")
        fed = replace(fed, sites=[s for s in fed.sites if s.name in config.sites])
    _FEDERATIONS[key] = fed
    while len(_FEDERATIONS) > _FEDERATION_CACHE_SIZE:
        _FEDERATIONS.popitem(last=False)
    return fed


def pool_sites(sites: Sequence[SiteData]) -> SiteData:
    """All sites' train and val splits concatenated (the centralized reference's data)."""

    def cat(parts: list[LabeledImages]) -> LabeledImages:
        first = parts[0]
        domains = [p.domain for p in parts]
        return LabeledImages(
            images=np.concatenate([p.images for p in parts]),
            labels=np.concatenate([p.labels for p in parts]),
            class_names=first.class_names,
            task=first.task,
            domain=None if any(d is None for d in domains) else np.concatenate(domains),
            meta={**first.meta, "site": "pooled"},
        )

    return SiteData(name="pooled", train=cat([s.train for s in sites]), val=cat([s.val for s in sites]))


# ----------------------------------------------------------------------------------------- one cell
class _TestScorer:
    """Scores parameter sets on the global test set with one model of the cells' architecture.

    threshold "youden": multi-label predictions use per-finding thresholds maximising Youden's J on
    ``val`` (the union of the sites' validation splits) for the model being scored.
    ``score_test=False`` (tuning cells): :meth:`metrics` returns nothing and the test set is never read.
    """

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


def _client_result(site: str, out: RoundOutput) -> ClientResult:
    """A site's round as the NVFlare client script sends it (same meta keys)."""
    meta = {META_NUM_SAMPLES: out.num_samples, META_NUM_STEPS: out.num_steps, META_SCALARS: out.scalars}
    return ClientResult(site=site, params=out.params, meta=meta, metrics=out.metrics)


def _scored(t: int, every: int) -> bool:
    """Whether the global model received in round t (row t - 1) is scored: rows 0, k, 2k, ...
    (the final model, row T, is always scored after the last round)."""
    return (t - 1) % every == 0


def _run_federated(
    spec: MethodSpec, fed: Federation, args: ClientArgs, config: BenchConfig, score_test: bool = True
) -> tuple[list[dict], np.ndarray]:
    """A federated run in the controller's order (module docstring); (rows, final test scores (1, N, C))."""
    rounds = config.rounds
    scheme = spec.make_scheme()
    scorer = _TestScorer(args, fed.test, pool_sites(fed.sites).val, config.threshold, score_test)
    use_model_buffers(scheme, scorer.model)  # geometry over the model's parameters, as the sites' own
    backend = PlaintextBackend(scorer.initial_params())
    step = RoundStep(
        scheme,
        backend,
        num_rounds=rounds,
        min_clients=config.min_clients,
        max_share=config.max_share,
        update_norm_bound=config.update_norm_bound,
        min_update_cosine=config.min_update_cosine,
        log=logger.warning,
    )
    sites = make_sites(fed.sites, fed.test, args, config.site_workers)
    recorder = RoundRecorder(None, str(spec.scheme))
    try:
        if spec.needs_statistics():  # the statistics phase: sum_k v_k over all sites, decoded at each site
            # each site contributes what it may release (noised when statistics DP is on), as its client does
            releases = sites.released_statistics().values()
            sites.set_global_stats(global_stats_of((r.class_counts, r.num_samples) for r in releases))
        for t in range(1, rounds + 1):
            t0 = time.perf_counter()
            global_params = backend.task_params()
            scored = _scored(t, config.eval_every)
            targets = sample_sites(sites.names, fed.sample_fraction, config.min_clients, args.seed, t)
            plan = step.plan(str(spec.scheme), spec.scheme_args)
            outs = sites.run_round(targets, global_params, t, plan, rounds, scored)
            outcome = step.run(t, [_client_result(site, out) for site, out in outs.items()], targets)
            test = scorer.metrics(global_params) if scored else {}
            recorder.add_outcome(outcome, round_seconds=time.perf_counter() - t0)
            recorder.set_metrics(t - 1, test)
        global_params = backend.task_params()
        final = sites.evaluate(global_params)  # the controller's final validate task, sent to every site
    finally:
        sites.close()
    recorder.set_metrics(rounds, {**mean_metrics(final), **scorer.metrics(global_params)})
    return _plain_rows(recorder.rows), scorer.scores(global_params)[None]


def _plain_rows(rows: list[dict]) -> list[dict]:
    """Rows as the benchmark stores them: without the controller's per-round bookkeeping keys."""
    return [
        {k: v for k, v in row.items() if k not in ("excluded", "global_updated", "bounded")} for row in rows
    ]


def _run_centralized(
    fed: Federation, args: ClientArgs, config: BenchConfig, score_test: bool = True
) -> tuple[list[dict], np.ndarray]:
    """One trainer on all sites' data pooled, T rounds of the same local training as a site."""
    rounds = config.rounds
    pooled = pool_sites(fed.sites)
    trainer = SiteTrainer(pooled, fed.test, args, threads=args.threads or None)
    scorer = _TestScorer(args, fed.test, pooled.val, config.threshold, score_test)
    params = scorer.initial_params()
    rows = RoundRecorder(None, "centralized")
    for t in range(1, rounds + 1):
        t0 = time.perf_counter()
        scored = _scored(t, config.eval_every)
        out = trainer.run_round(params, t - 1, {}, total_rounds=rounds, evaluate_received=scored)
        rows.set_metrics(t - 1, {**out.metrics, **(scorer.metrics(params) if scored else {})})
        params = out.params
        rows.set_metrics(t, {"round_seconds": time.perf_counter() - t0})
    set_params(trainer.model, params)
    rows.set_metrics(rounds, {**trainer.evaluate(), **scorer.metrics(params)})
    return rows.rows, scorer.scores(params)[None]


def _run_local(
    fed: Federation, args: ClientArgs, config: BenchConfig, score_test: bool = True
) -> tuple[list[dict], np.ndarray]:
    """Each site trains alone for T rounds. Rows hold the mean over sites of each site's own model:
    validation metrics every round, test metrics at round 0 (the shared theta^0) and round T only
    (scoring K models on the test set every round would cost more than the training)."""
    rounds = config.rounds
    trainers = {s.name: SiteTrainer(s, fed.test, args, threads=args.threads or None) for s in fed.sites}
    scorer = _TestScorer(args, fed.test, pool_sites(fed.sites).val, config.threshold, score_test)
    initial = scorer.initial_params()
    params = {name: initial for name in trainers}
    rows = RoundRecorder(None, "local")
    rows.set_metrics(0, scorer.metrics(initial))
    for t in range(1, rounds + 1):
        t0 = time.perf_counter()
        val = []
        scored = _scored(t, config.eval_every)
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


def without_test(fed: Federation) -> Federation:
    """``fed`` with an empty test set (same classes and image shape): what a tuning cell trains on,
    so that nothing in it can read a test image or label."""
    return replace(fed, test=fed.test.subset(np.arange(0)))


def run_cell(
    config: BenchConfig, scenario: str, method: str, seed: int, validation_only: bool = False
) -> tuple[dict, np.ndarray, np.ndarray]:
    """Run one cell; returns (record, scores (S, N, C) of the final model(s) on the test set, test labels).

    The record holds ``rows`` in the controller's format: ``round`` (0 = initial model), the mean
    site metrics (``val_*``, ``train_loss``), the test metrics (``test_*``), and for training rounds
    ``weights`` and the scheme's schedule values. ``validation_only`` (tuning cells): the cell runs
    on the federation :func:`without_test`, its rows hold no test metrics and the scores are empty.
    """
    spec = config.spec(method)
    args = cell_args(config, scenario, seed, spec)
    fed = federation_for(config, scenario, seed)
    if validation_only:
        fed = without_test(fed)
    score_test = not validation_only
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        # a small site's validation split under label skew lacks classes: scikit-learn says so per call
        warnings.filterwarnings("ignore", message="y_pred contains classes not in y_true")
        if spec.kind == "federated":
            rows, scores = _run_federated(spec, fed, args, config, score_test)
        elif spec.kind == "centralized":
            rows, scores = _run_centralized(fed, args, config, score_test)
        else:
            rows, scores = _run_local(fed, args, config, score_test)
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
        "seconds": time.perf_counter() - t0,
    }
    return record, scores, np.asarray(fed.test.labels)


def run_and_store_cell(config: BenchConfig, scenario: str, method: str, seed: int, cells_dir: str) -> str:
    """Run one cell and store it in ``cells_dir`` (predictions first, the JSON record last); returns its key."""
    record, scores, labels = run_cell(config, scenario, method, seed)
    return store_cell(Path(cells_dir), record, scores, labels)


def _worker_init() -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)


# --------------------------------------------------------------------------------------- tuning
def _tuning_label(method: str, point: dict) -> str:
    """The label of a tuning cell: the method's label with the grid point's options appended."""
    opts = ",".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in point.items())
    return f"{method}{',' if ':' in method else ':'}{opts}"


def tune_methods(config: BenchConfig, out_dir: Path, progress: bool = False) -> tuple[dict, dict]:
    """Run the tuning cells of ``config.tune``; returns (label -> chosen options, tuning record).

    Each grid point of a method runs once on ``config.tune_scenario`` with ``config.tune_seed``, the
    test set removed (:func:`without_test`); the point with the largest final validation AUC wins
    (the first listed on a tie; a NaN AUC never wins). Finished tuning cells are kept in
    ``out_dir/tuning/`` and reused when their settings are unchanged.
    """
    scenario, seed = str(config.tune_scenario), int(config.tune_seed or 0)
    tuning_dir = out_dir / TUNING_DIR
    tuning_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(m, point) for m in config.methods for point in config.tune_grid(m)]
    chosen: dict[str, dict] = {}
    record: dict[str, dict] = {}
    bar = tqdm(total=len(jobs), desc="bench tuning", unit="cell", disable=not progress or not jobs)
    try:
        for method in config.methods:
            grid = config.tune_grid(method)
            if not grid:
                continue
            points = []
            for point in grid:
                probe = replace(config, tuned={method: point})
                key = cell_key(scenario, _tuning_label(method, point), seed)
                digest = settings_hash(probe, scenario, method, seed)
                stored = load_cell(tuning_dir, key)
                if stored is None or stored.get("settings_hash") != digest:
                    try:
                        stored, _, _ = run_cell(probe, scenario, method, seed, validation_only=True)
                    except Exception as e:
                        raise BenchError(f"tuning cell {key} failed: {type(e).__name__}: {e}") from e
                    stored["key"] = key
                    atomic_write_text(tuning_dir / f"{key}.json", json.dumps(stored, indent=1, default=float))
                val_auc = float(stored["rows"][-1].get("val_auc", float("nan")))
                points.append({"options": point, "val_auc": val_auc, "key": key})
                bar.update(1)
            finite = [p for p in points if np.isfinite(p["val_auc"])]
            best = max(finite, key=lambda p: p["val_auc"]) if finite else points[0]
            chosen[method] = dict(best["options"])
            record[method] = {
                "scenario": scenario,
                "seed": seed,
                "selected_by": "val_auc",
                "grid": points,
                "chosen": chosen[method],
            }
            logger.warning("tuning %s on %s, seed %d: chose %s", method, scenario, seed, chosen[method])
    finally:
        bar.close()
    return chosen, record


# ------------------------------------------------------------------------------------------ the run
@dataclass
class BenchResult:
    """What :func:`run_bench` did: the summary, how many cells it trained and skipped, the output folder."""

    summary: dict
    trained: int
    skipped: int
    out_dir: Path


def engine_layout(cells: int, cores: int | None = None) -> tuple[int, int]:
    """(cell processes, site processes per cell) that keep ``cores`` busy with one torch thread each.

    As many cells in parallel as there are cores; when there are fewer cells than cores, the spare
    cores train each cell's sites in parallel (measured on 2 cores: two single-thread workers move
    about 3x the images of one two-thread worker, docs/bench.md "Engine").
    """
    cores = max(1, cores or os.cpu_count() or 1)
    jobs = max(1, min(cores, cells))
    return jobs, max(1, cores // jobs)


def _run_on_cluster(
    config: BenchConfig, todo: list[tuple[str, str, int]], address: str, cells_dir: Path, bar, failures: dict
) -> None:
    """Run the cells on an existing Dask cluster (``fedweigh[cluster]``); results are stored here."""
    try:
        from distributed import Client
        from distributed import as_completed as dask_completed
    except ImportError:
        raise BenchError(
            "--cluster needs Dask's distributed scheduler: pip install 'fedweigh[cluster]' here and on the workers"
        ) from None
    with Client(address, set_as_default=False) as client:
        futures = {
            client.submit(run_cell, config, sc, m, s, pure=False): cell_key(sc, m, s) for sc, m, s in todo
        }
        for fut in dask_completed(list(futures), loop=client.loop):
            key = futures[fut]
            try:
                record, scores, labels = fut.result()
                store_cell(cells_dir, record, scores, labels)
            except Exception as e:
                logger.error("cell %s failed: %s", key, e)
                failures[key] = f"{type(e).__name__}: {e}"
            bar.set_postfix_str(key)
            bar.update(1)


def run_bench(
    config: BenchConfig,
    out_dir: str | Path,
    jobs: int = 1,
    progress: bool = True,
    cluster: str | None = None,
) -> BenchResult:
    """Run every cell of ``config`` not yet stored in ``out_dir/cells``, then write the outputs.

    jobs > 1 runs cells in a process pool (torch uses one thread per worker); ``cluster`` (a Dask
    scheduler address, e.g. ``tcp://10.0.0.5:8786``) runs them on an existing cluster instead.
    Outputs: ``results.csv``, ``summary.json``, ``report.md`` and ``plots/`` (see
    :mod:`fedweigh.bench.report`). Raises :class:`BenchError` naming the failed cells after the
    others have finished.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    start = time.perf_counter()
    out = Path(out_dir)
    cells_dir = out / CELLS_DIR
    cells_dir.mkdir(parents=True, exist_ok=True)
    tuning: dict = {}
    if config.tune:
        chosen, tuning = tune_methods(config, out, progress)
        config = replace(config, tuned=chosen)
    (out / CONFIG_JSON).write_text(json.dumps(config.as_dict(), indent=1, default=str))
    cells = config.cells()
    todo = [c for c in cells if not is_done(cells_dir, config, *c)]
    failures: dict[str, str] = {}
    bar = tqdm(total=len(todo), desc=f"bench {config.profile}", unit="cell", disable=not progress or not todo)
    try:
        if cluster and todo:
            _run_on_cluster(config, todo, cluster, cells_dir, bar, failures)
        elif jobs == 1 or len(todo) <= 1:
            for scenario, method, seed in todo:
                bar.set_postfix_str(cell_key(scenario, method, seed))
                try:
                    run_and_store_cell(config, scenario, method, seed, str(cells_dir))
                except Exception as e:  # keep going: the other cells are still worth storing
                    logger.exception("cell %s failed", cell_key(scenario, method, seed))
                    failures[cell_key(scenario, method, seed)] = f"{type(e).__name__}: {e}"
                bar.update(1)
        else:
            ctx = mp.get_context("spawn")
            with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_worker_init) as pool:
                futures = {
                    pool.submit(run_and_store_cell, config, sc, m, s, str(cells_dir)): cell_key(sc, m, s)
                    for sc, m, s in todo
                }
                try:
                    for fut in as_completed(futures):
                        key = futures[fut]
                        try:
                            fut.result()
                        except Exception as e:
                            logger.error("cell %s failed: %s", key, e)
                            failures[key] = f"{type(e).__name__}: {e}"
                        bar.set_postfix_str(key)
                        bar.update(1)
                except KeyboardInterrupt:
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise
    finally:
        bar.close()
    if failures:
        lines = "\n".join(f"  {k}: {v}" for k, v in sorted(failures.items()))
        raise BenchError(f"{len(failures)} of {len(cells)} cell(s) failed (rerun to retry them):\n{lines}")
    records = []
    for scenario, method, seed in cells:
        record = load_cell(cells_dir, cell_key(scenario, method, seed))
        if record is None:
            raise BenchError(f"cell {cell_key(scenario, method, seed)} is missing from {cells_dir}")
        records.append(record)
    summary = write_outputs(config, records, out, start, jobs=jobs)
    if tuning:
        summary["tuning"] = tuning
        atomic_write_text(out / SUMMARY_JSON, json.dumps(summary, indent=1, default=float))
    return BenchResult(summary=summary, trained=len(todo), skipped=len(cells) - len(todo), out_dir=out)
