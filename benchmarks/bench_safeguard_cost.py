"""What the server's safeguards cost honest federations: the same benchmark cells with the
safeguards off, at the deployed defaults and with the robust options, paired cell by cell.

    PYTHONPATH=custom .venv/bin/python benchmarks/bench_safeguard_cost.py --profile standard \\
        --out results/safeguard-cost --json docs/results/security/safeguard-cost.json

Every setting runs the cells of ``--profile`` (its scenarios, methods and seeds unless given) with
the benchmark's engine (:func:`fedweigh.bench.runner.run_bench`) into ``OUT/<setting>/``; stored cells
are reused on a rerun. The settings are the bench's presets (:data:`fedweigh.bench.config.SAFEGUARDS`):
``off`` (the schemes as their papers define them; the reference), ``deploy`` (a job's defaults) and
``robust`` (the defaults with the weighted median and the per-array direction check). Per setting
it prints the mean test AUC effect against ``off`` over all cells with its 95% t-interval over the
cells (seeds x scenarios: training noise included) and its paired bootstrap interval over the test
images (:func:`fedweigh.bench.costs.honest_cost`), per method, and the honest site-rounds left
out or bounded and the rounds that left the model unchanged. Last line:
``safeguard cost: <setting> <effect> [<low>, <high>] left out <n> rounds lost <r>; ...``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from fedweigh.bench.config import SAFEGUARDS, make_config
from fedweigh.bench.costs import REFERENCE_SETTING, honest_cost
from fedweigh.bench.runner import run_bench
from fedweigh.io import atomic_write_text


def _list(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def markdown(record: dict) -> str:
    """The table of docs/security.md: one row per setting."""
    lines = [
        "| setting | mean AUC effect vs off, 95% t-interval over cells (seeds x scenarios) | 95% interval over "
        "test images | per method | honest site-rounds left out | site-rounds bounded | rounds lost |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, entry in record["settings"].items():
        e, c = entry.get("effect"), entry.get("effect_cells")
        if name == REFERENCE_SETTING:
            cells, images = "reference", "-"
        else:
            cells = (
                f"{c['mean']:+.4f} [{c['ci_low']:+.4f}, {c['ci_high']:+.4f}] ({c['cells']} cells)"
                if c
                else "n/a"
            )
            images = f"[{e['ci_low']:+.4f}, {e['ci_high']:+.4f}]" if e else "n/a"
        per = (
            "; ".join(f"{m} {v['mean']:+.4f}" for m, v in (entry.get("by_method") or {}).items() if v) or "-"
        )
        a = entry["audit"]
        lines.append(
            f"| {name} | {cells} | {images} | {per} | {a['site_rounds_left_out']} | {a['site_rounds_bounded']} "
            f"| {a['rounds_unchanged']} |"
        )
    return "\n".join(lines)


def summary_line(record: dict) -> str:
    parts = []
    for name, entry in record["settings"].items():
        if name == REFERENCE_SETTING:
            continue
        c, a = entry.get("effect_cells"), entry["audit"]
        shown = f"{c['mean']:+.4f} [{c['ci_low']:+.4f}, {c['ci_high']:+.4f}]" if c else "n/a"
        parts.append(
            f"{name} {shown} left out {a['site_rounds_left_out']} rounds lost {a['rounds_unchanged']}"
        )
    return "safeguard cost: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="standard")
    p.add_argument("--dataset", default="synthcxr")
    p.add_argument(
        "--settings", type=_list, default=list(SAFEGUARDS), help="comma-separated presets (off first)"
    )
    p.add_argument("--methods", type=_list, default=None)
    p.add_argument("--scenarios", type=_list, default=None)
    p.add_argument("--seeds", type=lambda t: [int(x) for x in _list(t)], default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples per cell")
    p.add_argument(
        "--out", default=None, help="folder for the cells of every setting (reused; required to run)"
    )
    p.add_argument("--json", default=None, help="file for the results (e.g. docs/results/security/...)")
    p.add_argument("--markdown", default=None, help="print the table of a results JSON and exit")
    ns = p.parse_args(argv)
    if ns.markdown:
        record = json.loads(Path(ns.markdown).read_text())
        print(markdown(record))
        return 0
    if ns.out is None:
        p.error("--out is required to run")
    if REFERENCE_SETTING not in ns.settings:
        p.error(f"--settings must include {REFERENCE_SETTING!r} (the reference)")
    start = time.perf_counter()
    dirs, config = {}, None
    for name in ns.settings:
        config = make_config(
            ns.profile,
            ns.dataset,
            methods=ns.methods,
            scenarios=ns.scenarios,
            seeds=ns.seeds,
            rounds=ns.rounds,
            safeguards=name,
        )
        out = Path(ns.out) / name
        t0 = time.perf_counter()
        result = run_bench(config, out, jobs=ns.jobs, progress=False)
        print(
            f"{name}: {result.trained} cell(s) trained, {result.skipped} reused, {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
        dirs[name] = out / "cells"
    assert config is not None
    cells = config.cells()
    settings = honest_cost(dirs, cells, n_resamples=ns.resamples)
    record = {
        "command": "PYTHONPATH=custom .venv/bin/python benchmarks/bench_safeguard_cost.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "profile": ns.profile,
        "dataset": ns.dataset,
        "rounds": config.rounds,
        "methods": list(config.methods),
        "scenarios": list(config.scenarios),
        "seeds": list(config.seeds),
        "safeguards": {
            name: {
                **{k: v for k, v in vars(SAFEGUARDS[name]).items() if k != "limits"},
                "limits": vars(SAFEGUARDS[name].limits),
            }
            for name in ns.settings
        },
        "seconds": round(time.perf_counter() - start, 1),
        "settings": settings,
    }
    if ns.json:
        atomic_write_text(Path(ns.json), json.dumps(record, indent=1, default=float) + "\n")
    print(markdown(record))
    print(summary_line(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
