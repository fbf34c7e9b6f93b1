"""The ``fedweigh bench`` sub-command (heavy modules are imported when it runs, not when parsing).

The flags that override the profile's client settings for a whole run are the
:class:`fedweigh.site.args.ClientArgs` fields declared ``bench=True``, added from their declarations
(:func:`fedweigh.site.args.add_client_options`); a method's own local training takes client options
in its label instead (``fedbb:optim=sgd,lr=0.01``).
"""

from __future__ import annotations

import argparse

__all__ = ["add_bench_parser", "main_bench"]

_DESCRIPTION = (
    "Run scenario x method x seed cells in one process on the NVFlare jobs' training and "
    "weighting code, then write results.csv, summary.json, report.md and plots/ into --out. "
    "A rerun skips the cells already stored in OUT/cells/. Methods may carry scheme, loss and "
    "client options, e.g. feddraw:beta_max=2.0,rho=0.5, fedbb:loss.mu=4, "
    "fedbb:optim=sgd,lr=0.01,momentum=0.9 (docs/bench.md)."
)
#: The server's safeguards the bench may set one by one (over ``--safeguards``), and their help.
_SAFEGUARD_FLAGS = {
    "--max-share": "cap on one site's share of a round's weight: auto, a number in (0, 1], or none",
    "--update-norm-bound": "bound on each update's norm, in medians of the other sites' (none: off)",
    "--min-update-cosine": "leave out an update opposing a consensus of the others' (none: off)",
    "--trim": "weight mass the trimmed mean cuts from each tail, in [0, 0.5)",
    "--array-cosine": "the direction check per array: leave out the arrays of an update that oppose the others' (none: off)",
    "--clip-norm": "clip every update to this absolute L2 norm, as Flower's fixed clipping (none: off)",
}


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``bench`` sub-command to ``subparsers`` (``set_defaults(func=main_bench)``): what runs
    (cells, tuning), the client settings it overrides, and how and where it runs."""
    from fedweigh.models import ARCHITECTURES
    from fedweigh.site.args import add_client_options, bench_options

    p = subparsers.add_parser(
        "bench",
        help="compare weighting methods across the client-partition scenarios (docs/bench.md)",
        description=_DESCRIPTION,
    )
    _add_cell_options(p)
    add_client_options(
        p,
        bench_options(),
        defaults="none",
        help_suffix=" (default: the profile's)",
        extras={
            "arch": {"choices": ARCHITECTURES},
            "pretrained": {"type": _checkpoint_file, "metavar": "PATH"},
            "threads": {
                "default": 1,
                "help": "torch threads per process (default 1: small models gain little)",
            },
        },
    )
    _add_engine_options(p)
    p.set_defaults(func=main_bench)
    return p


def _add_cell_options(p: argparse.ArgumentParser) -> None:
    """What runs: profile, dataset, methods, scenarios, seeds, rounds, tuning, scoring."""
    from fedweigh.bench.profiles import PROFILES
    from fedweigh.data import DATASETS
    from fedweigh.methods import ALL_METHODS, VARIANTS

    add = p.add_argument
    add("--profile", default="smoke", choices=tuple(PROFILES), help="run size (default: smoke)")
    add("--dataset", default="synthcxr", choices=DATASETS)
    add("--data", "--data-path", dest="data", default=None, help="dataset file/folder (chestmnist, chexpert)")
    known = f"known: {', '.join(ALL_METHODS)}; variants: {', '.join(VARIANTS)}"
    add("--methods", nargs="+", default=None, help=f"default: the profile's ({known})")
    add("--scenarios", nargs="+", default=None, help="default: the profile's (see `fedweigh scenarios`)")
    add(
        "--scenario-file",
        nargs="+",
        default=(),
        metavar="PATH",
        help="your own scenario(s), JSON or YAML (docs/bench.md); run after --scenarios, or alone without it",
    )
    add("--seeds", nargs="+", type=int, default=None, help="default: the profile's")
    add(
        "--exact-statistics",
        action="store_true",
        help="research runs: the sites release their exact label statistics (default: each site's one "
        "Gaussian release with the simulation policy's statistics_epsilon, 1.0; docs/privacy.md)",
    )
    add(
        "--tune",
        nargs="+",
        default=(),
        metavar="[METHOD:]KEY=V1,V2",
        help="tune an option per method on validation AUC before the reported cells, e.g. lr=3e-4,1e-3,3e-3 "
        "(every method's client lr) or fedprox:client_mu=0.001,0.01,0.1",
    )
    add("--tune-scenario", default=None, help="scenario the tuning cells run (default: the first scenario)")
    add("--tune-seed", type=int, default=None, help="seed of the tuning cells (default: largest seed + 1)")
    add("--rounds", type=int, default=None, help="override the profile's number of rounds")
    add(
        "--threshold",
        choices=("0.5", "youden"),
        default=None,
        help="multi-label 0/1 predictions for GM, precision, ...: 0.5 or Youden's J on validation (default: profile's)",
    )
    add(
        "--eval-every",
        type=int,
        default=None,
        help="score the global model every k rounds (default: profile's)",
    )


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    """How and where it runs: processes, the server's safeguards, a Dask cluster, the output folder."""
    add = p.add_argument
    add(
        "--jobs",
        type=int,
        default=0,
        help="cells run in parallel (processes); 0 = as many as cores (default)",
    )
    add(
        "--site-workers",
        type=int,
        default=0,
        help="processes a cell's sites train in, in parallel; 0 = the cores the cells leave free (default)",
    )
    add(
        "--safeguards",
        choices=("off", "deploy", "robust"),
        default="off",
        help="the server's safeguards: off (default: the schemes as their papers define them), deploy "
        "(the NVFlare controller's defaults) or robust (deploy with the weighted median and the per-array "
        "direction check); the options below override one each",
    )
    for flag, help_text in _SAFEGUARD_FLAGS.items():
        add(flag, type=_safeguard, default=argparse.SUPPRESS, help=help_text)
    add(
        "--aggregator",
        choices=("mean", "median", "trimmed_mean"),
        default=argparse.SUPPRESS,
        help="the scheme's weighted mean, or a weighted median / trimmed mean with the scheme's weights",
    )
    add("--krum-f", type=_krum_f, default=argparse.SUPPRESS, help="multi-Krum: sites tolerated (none: off)")
    add(
        "--cluster",
        default=None,
        metavar="ADDRESS",
        help="run the cells on an existing Dask cluster (scheduler address; needs fedweigh[cluster] there)",
    )
    add("--no-progress", action="store_true", help="no progress bar")
    add("--out", required=True, help="output folder (created; reused to resume)")


def _checkpoint_file(text: str) -> str:
    """``--pretrained``'s value: an existing checkpoint file, as an absolute path (cells may run in
    other processes)."""
    from pathlib import Path

    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such checkpoint file: {text!r}")
    return str(Path(text).resolve())


def _safeguard(text: str) -> float | str | None:
    """A safeguard option's value: ``none``, ``auto`` or a number."""
    if text.lower() == "none":
        return None
    if text.lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, 'auto' or 'none', got {text!r}") from None


def _krum_f(text: str) -> int | None:
    """``--krum-f``'s value: ``none`` or an integer (checked by the safeguards' rule)."""
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none', got {text!r}") from None


def _bench_config(args: argparse.Namespace):
    """The :class:`fedweigh.bench.runner.BenchConfig` the parsed arguments describe (ValueError,
    KeyError or ConfigError naming a bad one)."""
    from fedweigh.bench.config import Tuning, bench_safeguards, make_config
    from fedweigh.site.args import bench_options

    guards = {
        k: getattr(args, k)
        for k in (
            "max_share",
            "update_norm_bound",
            "min_update_cosine",
            "aggregator",
            "trim",
            "krum_f",
            "array_cosine",
            "clip_norm",
        )
        if hasattr(args, k)
    }
    return make_config(
        args.profile,
        args.dataset,
        data_path=args.data,
        methods=args.methods,
        scenarios=args.scenarios,
        seeds=args.seeds,
        rounds=args.rounds,
        threshold=args.threshold,
        eval_every=args.eval_every,
        safeguards=bench_safeguards(args.safeguards, **guards),
        tuning=Tuning.given(args.tune, args.tune_scenario, args.tune_seed),
        scenario_files=args.scenario_file,
        exact_statistics=bool(getattr(args, "exact_statistics", False)),
        **{name: getattr(args, name) for name in bench_options()},
    )


def _plan_line(config, args: argparse.Namespace, jobs: int, site_workers: int) -> str:
    """One line: what runs, and where."""
    cells = len(config.cells())
    tuning = sum(len(config.tune_grid(m)) for m in config.methods)
    where = (
        f"cluster {args.cluster}"
        if args.cluster
        else f"{jobs} cell process(es) x {site_workers} site process(es)"
    )
    extra = (
        f" (+ {tuning} tuning cell(s) on {config.tuning.scenario}, seed {config.tuning.seed})"
        if tuning
        else ""
    )
    return (
        f"fedweigh bench: {config.dataset}, profile {config.profile}: {len(config.scenarios)} scenario(s) x "
        f"{len(config.methods)} method(s) x {len(config.seeds)} seed(s) = {cells} cell(s), {config.rounds} rounds"
        f"{extra}; {where}"
    )


def _print_result(result) -> None:
    """Cells trained and reused, the average AUC ranks, Friedman's p-values, where the report is."""
    s = result.summary
    print(f"trained {result.trained} cell(s), reused {result.skipped}; {s['wall_seconds']:.0f} s")
    ranks = sorted(s["avg_rank_auc"].items(), key=lambda kv: kv[1])
    if ranks:
        print("average rank (AUC): " + ", ".join(f"{m} {r:.2f}" for m, r in ranks))
    for metric in ("auc", "gm"):
        p = s[f"friedman_p_{metric}"]
        print(f"Friedman p ({metric.upper()}): {'-' if p is None else f'{p:.4g}'}")
    print(f"report: {result.out_dir / 'report.md'}")


def main_bench(args: argparse.Namespace) -> int:
    """Run the benchmark described by the parsed arguments; 0 on success, 1 if cells failed, 2 for bad
    arguments."""
    import logging
    from dataclasses import replace

    from fedweigh.bench.runner import engine_layout, run_bench
    from fedweigh.errors import BenchError

    logging.basicConfig(level=logging.WARNING)
    try:
        config = _bench_config(args)
    except (ValueError, KeyError) as e:
        print(f"error: {e}")
        return 2
    jobs, site_workers = engine_layout(len(config.cells()))
    jobs = args.jobs or jobs
    # a cluster's workers run one cell each, sites in-process, unless asked otherwise
    site_workers = args.site_workers or (1 if args.jobs or args.cluster else site_workers)
    config = replace(config, site_workers=site_workers)
    print(_plan_line(config, args, jobs, site_workers))
    try:
        result = run_bench(config, args.out, jobs=jobs, progress=not args.no_progress, cluster=args.cluster)
    except BenchError as e:
        print(f"error: {e}")
        return 1
    _print_result(result)
    return 0
