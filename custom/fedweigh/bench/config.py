"""What defines a benchmark: :class:`BenchConfig` (profile, data, methods, scenarios, seeds, rounds, the
server's safeguards, tuning) and :func:`make_config`, which builds one from a profile and checks it.

The server's safeguards are the round step's own settings
(:class:`fedweigh.server.safeguards.Safeguards`): ``"off"`` (the default) runs the weighting schemes
exactly as their papers define them, ``"deploy"`` applies the NVFlare controller's defaults
(:data:`SAFEGUARDS`). Tuning (:class:`Tuning`) names options to tune per method before the reported
cells (:mod:`fedweigh.bench.tuning`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from fedweigh.bench.profiles import THRESHOLDS, Profile, get_profile
from fedweigh.checks import check_client_args, check_dataset_path, check_server_values
from fedweigh.data import DATASETS
from fedweigh.data.pools import dataset_classes
from fedweigh.data.scenario_file import load_scenario_file
from fedweigh.data.scenarios import Scenario, get_scenario
from fedweigh.errors import ConfigError
from fedweigh.methods import CLIENT_OPTION_ALIASES, CLIENT_OPTIONS, MethodSpec, parse_method
from fedweigh.server.safeguards import ROBUST_OPTIONS, Safeguards
from fedweigh.site.args import ClientArgs
from fedweigh.site.policy import PERMISSIVE_DEFAULT, SitePolicy

__all__ = [
    "SAFEGUARDS",
    "BenchConfig",
    "TuneSpec",
    "Tuning",
    "bench_safeguards",
    "cell_args",
    "find_scenario",
    "make_config",
    "parse_tune",
]

#: How the bench's option errors name their source.
_SOURCE = "bench"


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


@dataclass(frozen=True)
class Tuning:
    """Options to tune per method before the reported cells (``--tune``, :func:`parse_tune` texts or
    :class:`TuneSpec`), on ``scenario`` (``--tune-scenario``; default: the first reported scenario)
    with ``seed`` (``--tune-seed``; default: one above the largest reported seed, never a reported one).
    """

    specs: tuple[TuneSpec, ...]
    scenario: str | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        specs = tuple(s if isinstance(s, TuneSpec) else parse_tune(s) for s in self.specs)
        if not specs:
            raise ValueError("--tune-scenario and --tune-seed need --tune")
        object.__setattr__(self, "specs", specs)

    @classmethod
    def given(
        cls, tune: Sequence[str | TuneSpec] | None, scenario: str | None = None, seed: int | None = None
    ) -> Tuning | None:
        """The tuning the options ``--tune``, ``--tune-scenario`` and ``--tune-seed`` ask for: None when
        none is given; ValueError when ``--tune-scenario`` or ``--tune-seed`` come without ``--tune``."""
        if not tune and scenario is None and seed is None:
            return None
        return cls(tuple(tune or ()), scenario, seed)

    def resolved(self, scenarios: Sequence[str], seeds: Sequence[int]) -> Tuning:
        """This tuning with its scenario and seed set for cells of ``scenarios`` x ``seeds``."""
        seed = max(seeds) + 1 if self.seed is None else int(self.seed)
        if seed in seeds or seed < 0:
            raise ValueError(
                f"--tune-seed {seed} must be a non-negative seed no reported cell uses (seeds: {list(seeds)})"
            )
        return Tuning(self.specs, self.scenario or scenarios[0], seed)


#: The server's safeguards of a bench run (``--safeguards``): ``"off"`` (the default) runs the
#: weighting schemes exactly as their papers define them, so that a comparison measures the weighting
#: alone; ``"deploy"`` applies the NVFlare controller's defaults, to measure what a federation runs.
#: Off by default because, in converged runs, the direction check and the norm bound act on honest
#: sites: most often on the site whose data differ most from the others' (docs/bench.md).
#: ``"robust"``: the defaults with the weighted coordinate-wise median and the per-array direction
#: check (:mod:`fedweigh.server.robust`; docs/security.md measures what they cost and stop).
#: ``"hardened"``: ``"robust"`` with a weight cap below one half (``max_share=0.4``), so that no one
#: site can hold the weighted median (docs/security.md's setting for a federation that expects a
#: hostile site).
SAFEGUARDS: dict[str, Safeguards] = {
    "off": Safeguards.off(),
    "deploy": Safeguards(),
    "robust": Safeguards(aggregator="median", array_cosine=0.0),
    "hardened": Safeguards(aggregator="median", array_cosine=0.0, max_share=0.4),
}


def bench_safeguards(preset: str = "off", **options: Any) -> Safeguards:
    """The safeguards of preset ``preset`` (:data:`SAFEGUARDS`) with ``options`` (``max_share``,
    ``update_norm_bound``, ``min_update_cosine``, ``min_clients`` and the robust options
    ``aggregator``, ``trim``, ``krum_f``, ``array_cosine``, ``clip_norm``) set over it."""
    if preset not in SAFEGUARDS:
        raise ValueError(f"safeguards must be one of {', '.join(SAFEGUARDS)}, got {preset!r}")
    return replace(SAFEGUARDS[preset], **options, source=_SOURCE)


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
    threshold: ``"0.5"`` or ``"youden"``, for the thresholded test metrics (see :class:`Profile`).
    eval_every: score the global model (sites' validation splits, the test set) every k rounds and
        after the last round (1: every round). Training is the same for every k.
    site_workers: processes a cell's sites train in, in parallel (1: in the cell's process); changes
        no number.
    safeguards: the server's round step settings (min_clients and the safeguards of docs/security.md);
        off by default, so that the schemes run exactly as their papers define them;
        :data:`SAFEGUARDS` ``"deploy"`` gives the NVFlare controller's defaults.
    tuning: options to tune per method before the reported cells, and where (scenario, seed).
    """

    dataset: str
    profile: str
    client: ClientArgs
    rounds: int
    methods: tuple[str, ...]
    scenarios: tuple[str, ...]
    seeds: tuple[int, ...]
    sites: tuple[str, ...] | None = None
    threshold: str = "0.5"
    eval_every: int = 1
    site_workers: int = 1
    safeguards: Safeguards = field(default_factory=Safeguards.off)
    tuning: Tuning | None = None
    #: label -> options the cells of that method run with (set by the tuning; keys as in labels)
    tuned: dict = field(default_factory=dict)
    #: scenarios defined in files (``--scenario-file``), run like catalogue ones under their names
    scenario_defs: tuple[Scenario, ...] = ()
    #: research runs only: the sites release their exact label statistics (a simulation policy with
    #: ``statistics_epsilon`` None) instead of the default Gaussian release (``--exact-statistics``)
    exact_statistics: bool = False
    #: the federation declares its sites' training-set sizes (``Safeguards.declared_sizes``, each site's
    #: true size), as a consortium does when it provisions its sites; False: counts as reported
    declare_sizes: bool = True

    def site_policy(self) -> SitePolicy:
        """The policy every simulated site runs under: the simulation default (statistics noised with
        its ``statistics_epsilon`` unless the job sets ``stats_dp_epsilon``), or with
        :attr:`exact_statistics` the same with ``statistics_epsilon`` None."""
        if not self.exact_statistics:
            return PERMISSIVE_DEFAULT
        return replace(
            PERMISSIVE_DEFAULT,
            statistics_epsilon=None,
            source="benchmark --exact-statistics (research: exact label statistics)",
        )

    def statistics_epsilon(self) -> float | None:
        """The epsilon the cells' sites release their label statistics with (None: exact)."""
        config = self.client.stats_dp_config(self.site_policy().statistics_epsilon)
        return None if config is None else config.epsilon

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
        for t in self.tuning.specs if self.tuning else ():
            if t.applies_to(method):
                grid = [{**point, t.key: v} for point in grid for v in t.values]
        return grid if len(grid) > 1 or grid[0] else []

    def cells(self) -> list[tuple[str, str, int]]:
        """(scenario, method, seed) of every cell, grouped so that each federation is built once."""
        return [(sc, m, s) for s in self.seeds for sc in self.scenarios for m in self.methods]

    def as_dict(self) -> dict:
        """The settings as ``config.json`` records them (the safeguards and the tuning flat)."""
        tuning, guards = self.tuning, self.safeguards
        return {
            "dataset": self.dataset,
            "profile": self.profile,
            "client": asdict(self.client),
            "rounds": self.rounds,
            "methods": list(self.methods),
            "scenarios": list(self.scenarios),
            "seeds": list(self.seeds),
            "sites": list(self.sites) if self.sites else None,
            "min_clients": guards.min_clients,
            "threshold": self.threshold,
            "eval_every": self.eval_every,
            "site_workers": self.site_workers,
            "max_share": guards.max_share,
            "update_norm_bound": guards.update_norm_bound,
            "min_update_cosine": guards.min_update_cosine,
            **{name: getattr(guards, name) for name in ROBUST_OPTIONS},
            "tune": [asdict(t) for t in tuning.specs] if tuning else [],
            "tune_scenario": tuning.scenario if tuning else None,
            "tune_seed": tuning.seed if tuning else None,
            "tuned": self.tuned,
            "scenario_defs": [asdict(d) for d in self.scenario_defs],
            "exact_statistics": self.exact_statistics,
            "statistics_epsilon": self.statistics_epsilon(),
        }


def _check_grid(methods: tuple, scenarios: tuple, seeds: tuple, defs: tuple) -> None:
    """Every method and scenario known, none listed twice, at least one of each, seeds >= 0."""
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


def _scenario_classes(client: ClientArgs) -> tuple[str, ...] | None:
    """The finding names a scenario file's ``prevalence`` may use; None for a MedMNIST file of
    unknown classes (they are read from the file)."""
    if client.dataset == "chestmnist" and "class_names" not in client.loader_options:
        return None
    if client.dataset == "chestmnist":
        return tuple(client.loader_options["class_names"])
    return dataset_classes(client.dataset, client.loader_options)


def _client(prof: Profile, dataset: str, data_path: str | None, overrides: dict) -> ClientArgs:
    """The profile's client settings for ``dataset`` with ``overrides``, checked."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; known: {', '.join(DATASETS)}")
    if data_path is not None and not Path(os.path.expandvars(str(data_path))).exists():
        raise ConfigError(_SOURCE, "--data", data_path, "no such file or folder")
    check_dataset_path(_SOURCE, dataset, data_path, field="--data")
    return check_client_args(
        prof.client_args(dataset, data_path=data_path, **overrides), "bench client settings"
    )


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
    threshold: str | None = None,
    eval_every: int | None = None,
    site_workers: int = 1,
    safeguards: str | Safeguards = "off",
    tuning: Tuning | None = None,
    scenario_files: Sequence[str | Path] = (),
    exact_statistics: bool = False,
    **client_overrides: object,
) -> BenchConfig:
    """A :class:`BenchConfig` from a profile; every argument left None keeps the profile's value.

    ``client_overrides`` are :class:`ClientArgs` fields (``num_images``, ``max_steps``, ``size``, ...).
    ``safeguards``: a preset name of :data:`SAFEGUARDS` or the round step's settings
    (:func:`bench_safeguards` sets options over a preset). ``tuning``: options to tune per method
    before the reported cells. ``exact_statistics``: the sites release exact label statistics
    (research runs; default: the sites' Gaussian release, :meth:`BenchConfig.site_policy`).
    ``scenario_files``: scenarios defined in JSON / YAML files
    (:mod:`fedweigh.data.scenario_file`); they run after those named in ``scenarios`` (with none
    named, only the files' scenarios run).
    Raises ValueError naming the bad dataset, scenario, method, seed, round count or tuned option.
    """
    guards = bench_safeguards(safeguards) if isinstance(safeguards, str) else safeguards
    prof = get_profile(profile)
    threshold = prof.threshold if threshold is None else str(threshold)
    if threshold not in THRESHOLDS:
        raise ValueError(f"threshold must be one of {THRESHOLDS}, got {threshold!r}")
    client = _client(prof, dataset, data_path, client_overrides)
    methods = tuple(methods or prof.default_methods())
    defs = tuple(load_scenario_file(f, _scenario_classes(client)) for f in scenario_files)
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
    check_server_values({"num_rounds": rounds, "eval_every": eval_every}, _SOURCE)
    if site_workers < 1:
        raise ValueError(f"site_workers must be >= 1, got {site_workers}")
    _check_grid(methods, scenarios, seeds, defs)
    if tuning is not None:
        tuning = tuning.resolved(scenarios, seeds)
        find_scenario(defs, str(tuning.scenario))
        for t in tuning.specs:
            if t.method is not None and not any(t.applies_to(m) for m in methods):
                raise ValueError(f"--tune {t.method}:{t.key}: no method {t.method!r} among {list(methods)}")
    config = BenchConfig(
        dataset=dataset,
        profile=profile,
        client=client,
        rounds=rounds,
        methods=methods,
        scenarios=scenarios,
        seeds=seeds,
        sites=tuple(sites) if sites else None,
        threshold=threshold,
        eval_every=eval_every,
        site_workers=site_workers,
        safeguards=guards,
        tuning=tuning,
        scenario_defs=defs,
        exact_statistics=bool(exact_statistics),
    )
    for label in methods:  # every grid point is a valid method configuration (one-line errors)
        for point in config.tune_grid(label):
            scenario = tuning.scenario if tuning else scenarios[0]
            cell_args(config, str(scenario), 0, parse_method(label).with_options(point))
    return config


def cell_args(config: BenchConfig, scenario: str, seed: int, spec: MethodSpec) -> ClientArgs:
    """The ClientArgs of one cell: the shared settings plus scenario, seed, the method's loss and the
    client options the method prescribes (they win over the shared settings)."""
    args = replace(config.client, dataset=config.dataset, seed=seed, eval_test=False)
    if spec.loss != "default" and args.loss == "default":  # the recipes' _client_with_loss rule
        args = replace(args, loss=spec.loss, loss_options=dict(spec.loss_options or args.loss_options))
    if spec.client_options:
        args = check_client_args(replace(args, **spec.client_options), f"method {spec.label!r}")
    return replace(args, scenario=scenario)  # set after the checks: a file's scenario is no catalogue name
