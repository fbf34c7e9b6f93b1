"""FedDRAW sensitivity study: which similarity, spread and prior bound to make the default.

Runs the ``standard`` bench profile (``fedweigh.bench``: the sites' and the server's own training and
weighting code) for FedDRAW variants and FedAvg over scenarios and seeds:

=====================================================  ==========================================
label                                                  reading
=====================================================  ==========================================
``feddraw``                                            literal: cos(theta_k, theta_g), min-max
``feddraw:similarity=direction``                       update vs previous global update, min-max
``feddraw:similarity=direction,spread=softmax``        direction, softmax of z-scores (tau 1)
``feddraw:spread=softmax``                             literal similarity, softmax spread
``feddraw:prior_factor=2``                             literal, similarity share in [p/2, 2p]
``feddraw:similarity=direction,spread=softmax,         direction, softmax, bounded by the prior
prior_factor=2``
``fedavg``                                             the size prior alone
=====================================================  ==========================================

Per variant the JSON holds the final test AUC per scenario and seed and their mean, and the weight
share of each cell's smallest site (by training-set size): its largest share over the rounds and
its mean share, next to its data share p_min. Cells are stored in ``OUT/cells`` and reused by a
rerun with the same settings. The table printed last is what the JSON holds, one row per variant.

    PYTHONPATH=custom .venv/bin/python benchmarks/feddraw_sensitivity.py --out feddraw-sensitivity
    PYTHONPATH=custom .venv/bin/python benchmarks/feddraw_sensitivity.py --out /tmp/fs --rounds 2 \\
        --seeds 0 --scenarios quantity-shift --max-steps 2 --num-images 240     # a smoke-size check
    PYTHONPATH=custom .venv/bin/python benchmarks/feddraw_sensitivity.py \
        --markdown docs/results/feddraw-sensitivity/feddraw_sensitivity.json        # the docs' table
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from fedweigh.bench import make_config, run_bench
from fedweigh.bench.cells import CELLS_DIR, cell_key, load_cell
from fedweigh.bench.config import SAFEGUARDS
from fedweigh.bench.federations import federation_for
from fedweigh.bench.runner import engine_layout

VARIANTS: tuple[str, ...] = (
    "feddraw",
    "feddraw:similarity=direction",
    "feddraw:similarity=direction,spread=softmax",
    "feddraw:spread=softmax",
    "feddraw:prior_factor=2",
    "feddraw:similarity=direction,spread=softmax,prior_factor=2",
    "fedavg",
)
SCENARIOS: tuple[str, ...] = ("quantity-shift", "label-a0.5")
SEEDS: tuple[int, ...] = (0, 1, 2)


def smallest_site_shares(record: dict, sizes: dict[str, int]) -> dict[str, float]:
    """The smallest site's data share p_min and its largest and mean weight share over the rounds."""
    smallest = min(sizes, key=lambda s: (sizes[s], s))
    shares = []
    for row in record["rows"]:
        weights = row.get("weights")
        if not weights:
            continue
        total = sum(weights.values())
        shares.append(weights.get(smallest, 0.0) / total if total > 0 else 0.0)
    return {
        "site": smallest,
        "data_share": sizes[smallest] / sum(sizes.values()),
        "max_share": max(shares) if shares else float("nan"),
        "mean_share": statistics.fmean(shares) if shares else float("nan"),
    }


def final_auc(record: dict) -> float:
    """The test AUC of the final global model (the last row that has one)."""
    for row in reversed(record["rows"]):
        if "test_auc" in row:
            return float(row["test_auc"])
    raise ValueError(f"cell {record['key']} has no test AUC")


def markdown_table(payload: dict) -> str:
    """The study as a markdown table (docs/methods.md quotes it): per variant the mean test AUC, the
    mean per scenario, the cells (scenario, seed) where it beats FedAvg, and the smallest site's mean
    and largest weight share next to its data share; rows by mean AUC."""
    variants = payload["variants"]
    scenarios = payload["scenarios"]
    fedavg = variants.get("fedavg")
    header = [
        "variant",
        "mean AUC",
        *scenarios,
        "cells above FedAvg",
        "smallest site: mean / largest share (data)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, v in sorted(variants.items(), key=lambda kv: -kv[1]["mean_auc"]):
        per = [f"{statistics.fmean(v['auc'][sc].values()):.4f}" for sc in scenarios]
        if fedavg is None or method == "fedavg":
            wins = "-"
        else:
            pairs = [
                (v["auc"][sc][seed], fedavg["auc"][sc][seed]) for sc in scenarios for seed in v["auc"][sc]
            ]
            wins = f"{sum(a > b for a, b in pairs)} of {len(pairs)}"
        share = (
            f"{v['smallest_site_mean_share']:.3f} / {v['smallest_site_max_share']:.3f} "
            f"({v['smallest_site_data_share']:.3f})"
        )
        lines.append(f"| `{method}` | {v['mean_auc']:.4f} | " + " | ".join(per) + f" | {wins} | {share} |")
    return "\n".join(lines)


def summarise(config, out: Path) -> dict:
    """Per variant: AUC per scenario and seed, their mean, and the smallest site's weight shares."""
    cells_dir = out / CELLS_DIR
    variants: dict[str, dict] = {}
    for method in config.methods:
        aucs: dict[str, dict[str, float]] = {}
        smallest: list[dict] = []
        for scenario in config.scenarios:
            for seed in config.seeds:
                record = load_cell(cells_dir, cell_key(scenario, method, seed))
                if record is None:
                    raise SystemExit(f"cell {cell_key(scenario, method, seed)} is missing from {cells_dir}")
                fed = federation_for(config, scenario, seed)
                sizes = {s.name: len(s.train) for s in fed.sites}
                aucs.setdefault(scenario, {})[str(seed)] = final_auc(record)
                smallest.append({"scenario": scenario, "seed": seed, **smallest_site_shares(record, sizes)})
        values = [v for per_seed in aucs.values() for v in per_seed.values()]
        variants[method] = {
            "mean_auc": statistics.fmean(values),
            "auc": aucs,
            "smallest_site": smallest,
            "smallest_site_max_share": statistics.fmean(c["max_share"] for c in smallest),
            "smallest_site_mean_share": statistics.fmean(c["mean_share"] for c in smallest),
            "smallest_site_data_share": statistics.fmean(c["data_share"] for c in smallest),
        }
    return variants


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="output folder (cells are reused by a rerun)")
    p.add_argument("--markdown", metavar="JSON", help="print the markdown table of a study's JSON and exit")
    p.add_argument("--dataset", default="synthcxr")
    p.add_argument(
        "--safeguards",
        choices=tuple(SAFEGUARDS),  # fedweigh.bench.config.SAFEGUARDS
        default="off",
        help="the server's safeguards: off (default; the weighting alone) or deploy (the controller's defaults)",
    )
    p.add_argument("--profile", default="standard")
    p.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), help="method labels (default: the grid above)"
    )
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS))
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    p.add_argument("--rounds", type=int, default=None, help="default: the profile's")
    p.add_argument("--max-steps", type=int, default=None, help="local step cap (default: the profile's)")
    p.add_argument("--num-images", type=int, default=None, help="pool size (default: the profile's)")
    p.add_argument("--jobs", type=int, default=0, help="cells in parallel; 0 = as many as cores")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument(
        "--json", default=None, help="where to write the JSON (default OUT/feddraw_sensitivity.json)"
    )
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown_table(json.loads(Path(args.markdown).read_text())))
        return 0
    if not args.out:
        p.error("--out is required")

    config = make_config(
        args.profile,
        args.dataset,
        methods=args.variants,
        scenarios=args.scenarios,
        seeds=args.seeds,
        rounds=args.rounds,
        max_steps=args.max_steps,
        num_images=args.num_images,
        threads=args.threads,
        safeguards=args.safeguards,
    )
    out = Path(args.out)
    jobs, _ = engine_layout(len(config.cells()))
    result = run_bench(config, out, jobs=args.jobs or jobs, progress=False)
    variants = summarise(config, out)
    payload = {
        "dataset": config.dataset,
        "profile": config.profile,
        "rounds": config.rounds,
        "scenarios": list(config.scenarios),
        "seeds": list(config.seeds),
        "max_steps": config.client.max_steps,
        "num_images": config.client.num_images,
        "safeguards": args.safeguards,
        "trained_cells": result.trained,
        "reused_cells": result.skipped,
        "variants": variants,
    }
    target = Path(args.json) if args.json else out / "feddraw_sensitivity.json"
    target.write_text(json.dumps(payload, indent=1))

    width = max(len(m) for m in variants)
    print(
        f"{'variant':<{width}}  mean AUC  per scenario (mean over seeds)        smallest site: max / mean share (data)"
    )
    for method, v in sorted(variants.items(), key=lambda kv: -kv[1]["mean_auc"]):
        per = ", ".join(f"{sc} {statistics.fmean(seeds.values()):.4f}" for sc, seeds in v["auc"].items())
        print(
            f"{method:<{width}}  {v['mean_auc']:.4f}    {per:<36}  {v['smallest_site_max_share']:.3f} / "
            f"{v['smallest_site_mean_share']:.3f} ({v['smallest_site_data_share']:.3f})"
        )
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
