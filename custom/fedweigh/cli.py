"""The ``fedweigh`` command line: demo, jobs export, scenarios."""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from fedweigh.protocol import AUC_PLOT, METRICS_CSV, METRICS_JSON, WEIGHTS_PLOT

DEFAULT_DEMO_JOB = "synthcxr_feddraw"


def _repo_jobs_dir() -> Path:
    """``jobs/`` of the source checkout when run from one, else ``./jobs``."""
    here = Path(__file__).resolve().parents[2] / "jobs"
    return here if here.is_dir() else Path.cwd() / "jobs"


def find_server_app_dir(workspace: Path) -> Path | None:
    """The simulator's server app folder (where the controller writes its metrics)."""
    hits = sorted(workspace.rglob(METRICS_JSON), key=lambda p: p.stat().st_mtime)
    return hits[-1].parent if hits else None


def format_round_table(rows: list[dict]) -> str:
    """round | test AUC | test GM | val AUC (the global model after that many rounds)."""

    def fmt(v) -> str:
        return f"{v:.4f}" if isinstance(v, float) and math.isfinite(v) else "   -  "

    lines = ["round  test_auc  test_gm   val_auc   val_gm"]
    for r in rows:
        lines.append(
            f"{r['round']:>5}  {fmt(r.get('test_auc'))}    {fmt(r.get('test_gm'))}    "
            f"{fmt(r.get('val_auc'))}    {fmt(r.get('val_gm'))}"
        )
    return "\n".join(lines)


def simulator_command(
    job_dir: Path, workspace: Path, n_clients: int, threads: int | None = None
) -> list[str]:
    """The argv of ``nvflare simulator JOB -w WS -n N -t T`` (T defaults to N) with this interpreter."""
    cli = [sys.executable, "-m", "nvflare.cli", "simulator", str(job_dir), "-w", str(workspace)]
    return [*cli, "-n", str(n_clients), "-t", str(threads or n_clients)]


def run_simulator(job_dir: Path, workspace: Path, n_clients: int, threads: int | None = None) -> int:
    """``nvflare simulator JOB -w WS -n N -t T`` as a child process; returns its exit code."""
    cmd = simulator_command(job_dir, workspace, n_clients, threads)
    print("$ nvflare simulator", " ".join(cmd[4:]), flush=True)
    return subprocess.call(cmd)


def cmd_demo(args: argparse.Namespace) -> int:
    from fedweigh.records import load_rows  # matplotlib: loaded only when a demo runs

    job_dir = Path(args.job) if args.job else _repo_jobs_dir() / DEFAULT_DEMO_JOB
    if not (job_dir / "meta.json").is_file():
        print(f"error: {job_dir} is not an NVFlare job folder (no meta.json); run `fedweigh jobs export`")
        return 2
    workspace = Path(args.workspace or f"workspaces/demo_{job_dir.name}").resolve()
    start = time.perf_counter()
    rc = run_simulator(job_dir, workspace, args.clients)
    wall = time.perf_counter() - start
    app = find_server_app_dir(workspace)
    if rc != 0 or app is None:
        print(f"error: the simulator run failed (exit code {rc}); see logs under {workspace}")
        return rc or 1
    rows = load_rows(app / METRICS_JSON)
    print()
    print(f"{job_dir.name}: global model by round (simulator, {args.clients} sites, {wall:.0f} s)")
    print(format_round_table(rows))
    final = rows[-1] if rows else {}
    if "test_auc" in final:
        print(f"\nfinal test macro AUC {final['test_auc']:.4f}, GM {final.get('test_gm', float('nan')):.4f}")
    print(f"metrics:  {app / METRICS_JSON} (and {METRICS_CSV})")
    for plot in (WEIGHTS_PLOT, AUC_PLOT):
        if (app / plot).is_file():
            print(f"plot:     {app / plot}")
    models = sorted(p for p in workspace.rglob("*.pt"))
    if models:
        print(f"model:    {models[-1]}")
    print(f"tensorboard: tensorboard --logdir {workspace}")
    return 0


def cmd_jobs_export(args: argparse.Namespace) -> int:
    from fedweigh.flare.jobs import export_jobs

    for path in export_jobs(
        args.out, args.names or None, bundle=args.bundle, site_installed=args.site_installed
    ):
        print(f"exported {path}")
    return 0


def cmd_scenarios(args: argparse.Namespace) -> int:
    from fedweigh.data.scenarios import scenario_table

    print(scenario_table())
    return 0


def cmd_policy(args: argparse.Namespace) -> int:
    import json

    from fedweigh.policy import load_site_policy

    try:
        policy = load_site_policy(args.kit)
    except (OSError, ValueError) as e:
        print(f"error: {e}")
        return 2
    print(f"site policy: {policy.source}")
    print(json.dumps(policy.as_dict(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedweigh", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo", help="run the demo job in the NVFlare simulator and print per-round metrics"
    )
    demo.add_argument("--job", help=f"job folder (default: jobs/{DEFAULT_DEMO_JOB})")
    demo.add_argument("--workspace", help="simulator workspace (default: workspaces/demo_<job>)")
    demo.add_argument("--clients", type=int, default=4)
    demo.set_defaults(func=cmd_demo)

    jobs = sub.add_parser("jobs", help="job folders")
    jobs_sub = jobs.add_subparsers(dest="jobs_command", required=True)
    export = jobs_sub.add_parser("export", help="regenerate job folders from the recipes")
    export.add_argument("names", nargs="*", help="job names (default: all)")
    export.add_argument("--out", default=str(_repo_jobs_dir()))
    code = export.add_mutually_exclusive_group()
    code.add_argument(
        "--bundle",
        action="store_true",
        help="ship the whole fedweigh package in each job's custom/ folder (bring-your-own-code job; "
        "the submitter needs the byoc right)",
    )
    code.add_argument(
        "--site-installed",
        action="store_true",
        help="ship no code: for sites that installed fedweigh and allow-listed its component classes "
        "(provisioning/resources.json)",
    )
    export.set_defaults(func=cmd_jobs_export)

    policy = sub.add_parser(
        "policy",
        help="show the privacy policy a site runs under (its local/fedweigh_policy.json or the default)",
    )
    policy.add_argument("kit", nargs="?", default=None, help="the site's startup kit folder (default: here)")
    policy.set_defaults(func=cmd_policy)

    scen = sub.add_parser("scenarios", help="list the client-partition scenarios")
    scen.set_defaults(func=cmd_scenarios)

    from fedweigh.bench.cli import add_bench_parser
    from fedweigh.explain import add_explain_parser

    add_explain_parser(sub)
    add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
