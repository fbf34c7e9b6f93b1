"""FedDRAW's overhead in a real NVFlare run, and the server's cost for 10 DenseNet121 clients.

Part 1 runs the same job twice with ``nvflare simulator`` — once with stock NVFlare ``FedAvg``
(``FedAvgRecipe``), once with fedweigh's controller and FedDRAW — and compares the mean round wall
time, read from the server log's round-start timestamps (round 1 excluded: it includes start-up).
Target ratio FedDRAW / FedAvg <= 1.05.

Part 2 times FedDRAW's and FedAvg's server work (weights + aggregate) for 10 clients holding MONAI
DenseNet121 parameters (7M values). Target <= 1 s.

    .venv/bin/python benchmarks/bench_round_time.py [--rounds 5] [--clients 4] [--num-images 8000] \
        [--repeats 2] [--json docs/results/round-time/round-time.json]

``--repeats N`` runs the two jobs N times each, alternating (stock, fedweigh, stock, ...), so that a
change in the machine's load falls on both; the ratio reported is that of the medians, next to each
repeat's own ratio. ``--json`` keeps every figure with the command that made it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import numpy as np

from fedweigh.cli import simulator_command
from fedweigh.flare.jobs import _job
from fedweigh.flare.recipes import CLIENT_SCRIPT, ModelSpec
from fedweigh.site.args import ClientArgs

ROUND_RATIO_TARGET = 1.05
SERVER_TARGET_S = 1.0
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def round_starts(log: Path, pattern: str) -> list[datetime]:
    """Timestamps of the server-log lines that match ``pattern`` (a line inside a multi-line message,
    such as NVFlare's framed "Round N started.", takes the timestamp of the message's first line)."""
    out, stamp = [], None
    for line in log.read_text(errors="replace").splitlines():
        m = _STAMP.match(line)
        if m:
            stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
        if stamp is not None and re.search(pattern, line):
            out.append(stamp)
    return out


def simulate(job_root: Path, name: str, clients: int, workspace: Path) -> float:
    t0 = time.perf_counter()
    cmd = simulator_command(job_root / name, workspace, clients)
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def mean_round_seconds(starts: list[datetime], end: datetime) -> float:
    """Mean duration of rounds 2..T (each round ends where the next starts; the last at ``end``)."""
    marks = starts[1:] + [end]
    return statistics.mean((b - a).total_seconds() for a, b in zip(starts[1:], marks[1:], strict=True))


def part1(args: argparse.Namespace) -> dict:
    from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe

    client = ClientArgs(dataset="synthcxr", scenario="iid-4", num_images=args.num_images, epochs=1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        feddraw = _job("feddraw", client, rounds=args.rounds, sites=args.clients)("bench_feddraw")
        stock = FedAvgRecipe(
            name="bench_fedavg",
            model={
                "class_path": "fedweigh.models.base.FedweighNet",
                "args": asdict(ModelSpec(seed=client.seed)),
            },
            min_clients=args.clients,
            num_rounds=args.rounds,
            train_script=CLIENT_SCRIPT,
            train_args=client.to_argv(),
            key_metric="val_auc",
        )
        results: dict[str, list[float]] = {}
        jobs = (
            ("stock FedAvg", stock, r"Round \d+ started", r"Finished FedAvg"),
            ("fedweigh FedDRAW", feddraw, r"round \d+/\d+: sites", r"round \d+: weights"),
        )
        for recipe in (stock, feddraw):
            recipe.export(str(tmp / "jobs"))
        for repeat in range(args.repeats):
            for label, recipe, pattern, final in jobs:
                ws = tmp / f"ws_{recipe.name}_{repeat}"
                wall = simulate(tmp / "jobs", recipe.name, args.clients, ws)
                log = ws / "server" / "simulate_job" / "log.txt"
                if not log.is_file():
                    log = next(ws.rglob("log.txt"))
                starts = round_starts(log, pattern)
                ends = round_starts(log, final)
                per_round = mean_round_seconds(starts, ends[-1])
                results.setdefault(label, []).append(per_round)
                print(
                    f"{label:18s} repeat {repeat + 1}: {len(starts)} rounds, mean round {per_round:6.2f} s "
                    f"(rounds 2..T), job wall {wall:.0f} s",
                    flush=True,
                )
        fedavg, feddraw_s = results["stock FedAvg"], results["fedweigh FedDRAW"]
        ratio = statistics.median(feddraw_s) / statistics.median(fedavg)
        each = [b / a for a, b in zip(fedavg, feddraw_s, strict=True)]
        print(
            f"round time ratio FedDRAW / FedAvg = {ratio:.3f} (target <= {ROUND_RATIO_TARGET}; "
            f"each repeat: {', '.join(f'{r:.3f}' for r in each)})"
        )
        return {
            "mean_round_seconds": results,
            "ratio_of_medians": round(ratio, 4),
            "ratio_per_repeat": [round(r, 4) for r in each],
            "target": ROUND_RATIO_TARGET,
        }


def part2(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_server_weights import client_params, densenet121_shapes, make_reports, random_params

    from fedweigh.weighting import get_scheme

    rng = np.random.default_rng(0)
    global_params = random_params(densenet121_shapes(), rng)
    clients = [client_params(global_params, rng, 0.01 * (1 + i / 10)) for i in range(10)]
    out = {}
    for name, with_scalars in (("fedavg", True), ("feddraw", False)):
        times = []
        for _ in range(3):
            scheme = get_scheme(name)
            reports = make_reports(scheme, global_params, clients, rng, scalars=with_scalars)
            t0 = time.perf_counter()
            w = scheme.weights(reports, global_params, round_index=2, num_rounds=10)
            scheme.aggregate(global_params, reports, w)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        print(
            f"server weights+aggregate, 10 x DenseNet121, {name:8s}: {t:.3f} s (target <= {SERVER_TARGET_S} s)"
        )
        out[name] = round(t, 4)
    return {"server_seconds_10_densenet121": out, "target_s": SERVER_TARGET_S}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--num-images", type=int, default=8000)
    parser.add_argument("--skip-simulator", action="store_true")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each job, alternating (default 1)")
    parser.add_argument("--json", type=Path, default=None, help="write every figure and the command here")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    record: dict = {
        "command": " ".join(["PYTHONPATH=custom", ".venv/bin/python", *sys.argv]),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "cpus": os.cpu_count(),
        "load_average_at_start": list(os.getloadavg()),
    }
    if not args.skip_simulator:
        record["round_time"] = part1(args)
    record["server"] = part2(args)
    record["load_average_at_end"] = list(os.getloadavg())
    if args.json is not None:
        from fedweigh.io import atomic_write_text

        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.json, json.dumps(record, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
