"""Scale: 16 simulated sites x 20 rounds in the NVFlare simulator; server memory per round.

The controller records the server process's resident memory after every round (``server_rss_mb``,
current RSS, and ``server_peak_rss_mb``, the high-water mark). A flat series means the server does not
accumulate client results or models across rounds.

    .venv/bin/python benchmarks/bench_scale.py [--sites 16] [--rounds 20] [--scheme feddraw]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

from fedweigh.cli import simulator_command
from fedweigh.flare.jobs import _job
from fedweigh.server.records import load_rows
from fedweigh.site.args import ClientArgs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--scheme", default="feddraw")
    parser.add_argument("--num-images", type=int, default=3200)
    args = parser.parse_args()

    # many-50 has 50 sites; the simulator runs the first --sites of them
    client = ClientArgs(
        dataset="synthcxr",
        scenario="many-50",
        num_images=args.num_images,
        max_steps=2,
        batch_size=16,
        threads=1,
    )
    recipe = _job(args.scheme, client, rounds=args.rounds, sites=args.sites)(f"scale_{args.scheme}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        recipe.export(str(tmp / "jobs"))
        t0 = time.perf_counter()
        cmd = simulator_command(tmp / "jobs" / recipe.name, tmp / "ws", args.sites)
        subprocess.run(cmd, check=True, capture_output=True)
        wall = time.perf_counter() - t0
        rows = load_rows(next((tmp / "ws").rglob("fedweigh_metrics.json")))
    trained = [r for r in rows if "weights" in r]
    print(
        f"{args.sites} sites x {args.rounds} rounds ({args.scheme}): {len(trained)} rounds completed in {wall:.0f} s"
    )
    print("round  sites  server_rss_mb  server_peak_rss_mb")
    for r in trained:
        print(
            f"{r['round']:>5}  {len(r['weights']):>5}  {r.get('server_rss_mb', float('nan')):13.1f}  "
            f"{r.get('server_peak_rss_mb', float('nan')):18.1f}"
        )
    rss = [r["server_rss_mb"] for r in trained if "server_rss_mb" in r]
    if len(rss) >= 4:
        half = len(rss) // 2
        first, second = sum(rss[:half]) / half, sum(rss[half:]) / (len(rss) - half)
        print(
            f"mean RSS first half {first:.1f} MB, second half {second:.1f} MB, growth {second - first:+.1f} MB"
        )


if __name__ == "__main__":
    main()
