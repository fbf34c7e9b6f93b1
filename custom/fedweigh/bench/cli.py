"""The ``fedweigh bench`` sub-command (heavy modules are imported when it runs, not when parsing)."""

from __future__ import annotations

import argparse
import json


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``bench`` sub-command to ``subparsers`` (``set_defaults(func=main_bench)``)."""
    from fedweigh.bench.profiles import PROFILES
    from fedweigh.data import DATASETS
    from fedweigh.methods import ALL_METHODS, VARIANTS
    from fedweigh.models import ARCHITECTURES

    p = subparsers.add_parser(
        "bench",
        help="compare weighting methods across the client-partition scenarios (docs/bench.md)",
        description=(
            "Run scenario x method x seed cells in one process on the NVFlare jobs' training and "
            "weighting code, then write results.csv, summary.json, report.md and plots/ into --out. "
            "A rerun skips the cells already stored in OUT/cells/. Methods may carry scheme, loss and "
            "client options, e.g. feddraw:beta_max=2.0,rho=0.5, fedbb:loss.mu=4, "
            "fedbb:optim=sgd,lr=0.01,momentum=0.9 (docs/bench.md)."
        ),
    )
    p.add_argument("--profile", default="smoke", choices=tuple(PROFILES), help="run size (default: smoke)")
    p.add_argument("--dataset", default="synthcxr", choices=DATASETS)
    p.add_argument(
        "--data", "--data-path", dest="data", default=None, help="dataset file/folder (chestmnist, chexpert)"
    )
    p.add_argument(
        "--loader-options",
        type=json.loads,
        default=None,
        help='JSON for the loader, e.g. {"uncertainty": "zeros"}',
    )
    p.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help=f"default: the profile's (known: {', '.join(ALL_METHODS)}; variants: {', '.join(VARIANTS)})",
    )
    p.add_argument(
        "--scenarios", nargs="+", default=None, help="default: the profile's (see `fedweigh scenarios`)"
    )
    p.add_argument(
        "--scenario-file",
        nargs="+",
        default=(),
        metavar="PATH",
        help="your own scenario(s), JSON or YAML (docs/bench.md); run after --scenarios, or alone without it",
    )
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="default: the profile's")
    p.add_argument(
        "--tune",
        nargs="+",
        default=(),
        metavar="[METHOD:]KEY=V1,V2",
        help="tune an option per method on validation AUC before the reported cells, e.g. lr=3e-4,1e-3,3e-3 "
        "(every method's client lr) or fedprox:client_mu=0.001,0.01,0.1",
    )
    p.add_argument(
        "--tune-scenario", default=None, help="scenario the tuning cells run (default: the first scenario)"
    )
    p.add_argument(
        "--tune-seed", type=int, default=None, help="seed of the tuning cells (default: largest seed + 1)"
    )
    p.add_argument("--rounds", type=int, default=None, help="override the profile's number of rounds")
    p.add_argument("--num-images", type=int, default=None, help="override the profile's pool size")
    p.add_argument(
        "--test-images",
        type=int,
        default=None,
        help="images in the global test set (default: the profile's; SynthCXR generates any number)",
    )
    p.add_argument("--max-steps", type=int, default=None, help="override the profile's local step cap")
    p.add_argument(
        "--arch",
        default=None,
        choices=ARCHITECTURES,
        help="override the profile's network (any method on any)",
    )
    p.add_argument("--size", type=int, default=None, help="override the profile's image side in pixels")
    p.add_argument(
        "--pretrained",
        type=_checkpoint_file,
        default=None,
        metavar="PATH",
        help="checkpoint with the network's weights (the head is re-initialised); nothing is downloaded",
    )
    p.add_argument(
        "--threshold",
        choices=("0.5", "youden"),
        default=None,
        help="multi-label 0/1 predictions for GM, precision, ...: 0.5 or Youden's J on validation (default: profile's)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="cells run in parallel (processes); 0 = as many as cores (default)",
    )
    p.add_argument(
        "--site-workers",
        type=int,
        default=0,
        help="processes a cell's sites train in, in parallel; 0 = the cores the cells leave free (default)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per process (default 1: small models gain little)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="score the global model every k rounds (default: profile's)",
    )
    p.add_argument("--device", default=None, help="auto (CUDA when present, default), cpu, cuda, cuda:N")
    p.add_argument(
        "--keep-optimizer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep the sites' optimizer state across rounds (default: profile's)",
    )
    p.add_argument(
        "--channels-last",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="channels_last convolutions (default on)",
    )
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None, help="bf16 autocast on CUDA")
    p.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=None, help="torch.compile the site models"
    )
    p.add_argument(
        "--safeguards",
        choices=("off", "deploy"),
        default="off",
        help="the server's safeguards: off (default: the schemes as their papers define them) or deploy "
        "(the NVFlare controller's defaults); the three options below override one each",
    )
    p.add_argument(
        "--max-share",
        type=_safeguard,
        default=argparse.SUPPRESS,
        help="cap on one site's share of a round's weight: auto, a number in (0, 1], or none",
    )
    p.add_argument(
        "--update-norm-bound",
        type=_safeguard,
        default=argparse.SUPPRESS,
        help="bound on each update's norm, in medians of the other sites' (none: off)",
    )
    p.add_argument(
        "--min-update-cosine",
        type=_safeguard,
        default=argparse.SUPPRESS,
        help="leave out an update opposing a consensus of the others' (none: off)",
    )
    p.add_argument(
        "--cluster",
        default=None,
        metavar="ADDRESS",
        help="run the cells on an existing Dask cluster (scheduler address; needs fedweigh[cluster] there)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", required=True, help="output folder (created; reused to resume)")
    p.set_defaults(func=main_bench)
    return p


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


def main_bench(args: argparse.Namespace) -> int:
    """Run the benchmark described by the parsed arguments; 0 on success, 1 if cells failed."""
    import logging
    from dataclasses import replace

    from fedweigh.bench.config import Tuning, bench_safeguards, make_config
    from fedweigh.bench.runner import engine_layout, run_bench
    from fedweigh.errors import BenchError

    logging.basicConfig(level=logging.WARNING)
    try:
        config = make_config(
            args.profile,
            args.dataset,
            data_path=args.data,
            methods=args.methods,
            scenarios=args.scenarios,
            seeds=args.seeds,
            rounds=args.rounds,
            threshold=args.threshold,
            num_images=args.num_images,
            max_steps=args.max_steps,
            arch=args.arch,
            size=args.size,
            pretrained=args.pretrained,
            threads=args.threads,
            loader_options=args.loader_options,
            eval_every=args.eval_every,
            safeguards=bench_safeguards(
                args.safeguards,
                **{
                    key: getattr(args, key)
                    for key in ("max_share", "update_norm_bound", "min_update_cosine")
                    if hasattr(args, key)
                },
            ),
            device=args.device,
            keep_optimizer=args.keep_optimizer,
            channels_last=args.channels_last,
            amp=args.amp,
            compile=args.compile,
            tuning=Tuning.given(args.tune, args.tune_scenario, args.tune_seed),
            scenario_files=args.scenario_file,
            test_images=args.test_images,
        )
    except (ValueError, KeyError) as e:
        print(f"error: {e}")
        return 2
    cells = len(config.cells())
    tuning = sum(len(config.tune_grid(m)) for m in config.methods)
    jobs, site_workers = engine_layout(cells)
    jobs = args.jobs or jobs
    # a cluster's workers run one cell each, sites in-process, unless asked otherwise
    site_workers = args.site_workers or (1 if args.jobs or args.cluster else site_workers)
    config = replace(config, site_workers=site_workers)
    print(
        f"fedweigh bench: {config.dataset}, profile {config.profile}: {len(config.scenarios)} scenario(s) x "
        f"{len(config.methods)} method(s) x {len(config.seeds)} seed(s) = {cells} cell(s), {config.rounds} rounds"
        + (
            f" (+ {tuning} tuning cell(s) on {config.tuning.scenario}, seed {config.tuning.seed})"
            if tuning
            else ""
        )
        + "; "
        + (
            f"cluster {args.cluster}"
            if args.cluster
            else f"{jobs} cell process(es) x {site_workers} site process(es)"
        )
    )
    try:
        result = run_bench(config, args.out, jobs=jobs, progress=not args.no_progress, cluster=args.cluster)
    except BenchError as e:
        print(f"error: {e}")
        return 1
    s = result.summary
    print(f"trained {result.trained} cell(s), reused {result.skipped}; {s['wall_seconds']:.0f} s")
    ranks = sorted(s["avg_rank_auc"].items(), key=lambda kv: kv[1])
    if ranks:
        print("average rank (AUC): " + ", ".join(f"{m} {r:.2f}" for m, r in ranks))
    for metric in ("auc", "gm"):
        p = s[f"friedman_p_{metric}"]
        print(f"Friedman p ({metric.upper()}): {'-' if p is None else f'{p:.4g}'}")
    print(f"report: {result.out_dir / 'report.md'}")
    return 0
