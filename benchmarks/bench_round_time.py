"""FedDRAW's overhead in a real NVFlare run, and the server's cost for 10 DenseNet121 clients.

Part 1 runs the same job twice with ``nvflare simulator`` — once with stock NVFlare ``FedAvg``
(``FedAvgRecipe``), once with fedweigh's controller and FedDRAW — and compares the mean round wall
time, read from the server log's round-start timestamps (round 1 excluded: it includes start-up).
Target ratio FedDRAW / FedAvg <= 1.05.

Part 2 times FedDRAW's and FedAvg's server work (weights + aggregate) for 10 clients holding MONAI
DenseNet121 parameters (7M values). Target <= 1 s.

    .venv/bin/python benchmarks/bench_round_time.py [--rounds 5] [--clients 4] [--num-images 8000]
"""

from __future__ import annotations

import argparse
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


def part1(args: argparse.Namespace) -> None:
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
        results = {}
        for label, recipe, pattern, final in (
            ("stock FedAvg", stock, r"Round \d+ started", r"Finished FedAvg"),
            ("fedweigh FedDRAW", feddraw, r"round \d+/\d+: sites", r"round \d+: weights"),
        ):
            recipe.export(str(tmp / "jobs"))
            ws = tmp / f"ws_{recipe.name}"
            wall = simulate(tmp / "jobs", recipe.name, args.clients, ws)
            log = ws / "server" / "simulate_job" / "log.txt"
            if not log.is_file():
                log = next(ws.rglob("log.txt"))
            starts = round_starts(log, pattern)
            ends = round_starts(log, final)
            per_round = mean_round_seconds(starts, ends[-1])
            results[label] = per_round
            print(
                f"{label:18s} {len(starts)} rounds, mean round {per_round:6.2f} s (rounds 2..T), job wall {wall:.0f} s"
            )
        ratio = results["fedweigh FedDRAW"] / results["stock FedAvg"]
        print(f"round time ratio FedDRAW / FedAvg = {ratio:.3f} (target <= {ROUND_RATIO_TARGET})")


def part2(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_server_weights import client_params, densenet121_shapes, make_reports, random_params

    from fedweigh.weighting import get_scheme

    rng = np.random.default_rng(0)
    global_params = random_params(densenet121_shapes(), rng)
    clients = [client_params(global_params, rng, 0.01 * (1 + i / 10)) for i in range(10)]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--num-images", type=int, default=8000)
    parser.add_argument("--skip-simulator", action="store_true")
    args = parser.parse_args()
    if not args.skip_simulator:
        part1(args)
    part2(args)


if __name__ == "__main__":
    main()
