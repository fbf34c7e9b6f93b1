"""The ``fedweigh`` command line: demo, jobs export, site check, scenarios, bench, explain.

The application's entry point: it assembles the sub-commands of :mod:`fedweigh.flare` (jobs, the
simulator demo), :mod:`fedweigh.bench` and :mod:`fedweigh.explain`, each imported when its command
runs, so that ``fedweigh --help`` and the parser stay fast (torch, NVFlare and MONAI load in seconds).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from fedweigh.io import streamed_log
from fedweigh.kernels import pinned_env
from fedweigh.protocol import AUC_PLOT, METRICS_CSV, METRICS_JSON, WEIGHTS_PLOT

DEFAULT_DEMO_JOB = "synthcxr_feddraw"


def package_version() -> str:
    """The installed distribution's version, else the package's ``__version__``."""
    try:
        return metadata.version("fedweigh")
    except metadata.PackageNotFoundError:
        from fedweigh import __version__

        return __version__


def _repo_jobs_dir() -> Path:
    """``jobs/`` of the source checkout when run from one, else ``./jobs``."""
    here = Path(__file__).resolve().parents[2] / "jobs"
    return here if here.is_dir() else Path.cwd() / "jobs"


def find_server_app_dir(workspace: Path) -> Path | None:
    """The simulator's server app folder (where the controller writes its metrics)."""
    hits = sorted(workspace.rglob(METRICS_JSON), key=lambda p: p.stat().st_mtime)
    return hits[-1].parent if hits else None


def format_round_table(rows: list[dict]) -> str:
    """round | test AUC | test GM at 0.5 | val AUC | val GM | whether that round changed the model
    (round t: the global model after t rounds; 0: the initial model)."""

    def fmt(v) -> str:
        return f"{v:.4f}" if isinstance(v, float) and math.isfinite(v) else "   -  "

    def model(r: dict) -> str:
        if r["round"] == 0:
            return "initial"
        return "kept" if r.get("global_updated") is False or not r.get("weights") else "updated"

    lines = ["round  test_auc  test_gm   val_auc   val_gm    model"]
    for r in rows:
        lines.append(
            f"{r['round']:>5}  {fmt(r.get('test_auc'))}    {fmt(r.get('test_gm'))}    "
            f"{fmt(r.get('val_auc'))}    {fmt(r.get('val_gm'))}    {model(r)}"
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
    return subprocess.call(cmd, env=pinned_env())


def _has_scores(row: dict) -> bool:
    return any(isinstance(row.get(k), float) and math.isfinite(row[k]) for k in ("test_auc", "val_auc"))


def format_progress(row: dict, num_rounds: int | None = None) -> str:
    """One line per round t (the global model after t rounds): its scores, and whether round t
    changed the model (the sites' weights) or not (why: the sites whose results were left out)."""
    of = f"/{num_rounds}" if num_rounds else ""
    parts = [f"round {row['round']}{of}:"]
    for key, label in (("test_auc", "test AUC"), ("val_auc", "val AUC")):
        value = row.get(key)
        if isinstance(value, float) and math.isfinite(value):
            parts.append(f"{label} {value:.4f}")
    if not _has_scores(row):
        parts.append("not scored (no site evaluated this model)")
    weights = row.get("weights") or {}
    if row.get("global_updated") is False or (not weights and row.get("round", 0) >= 1):
        excluded = row.get("excluded") or {}
        why = "; ".join(f"{site}: {reason}" for site, reason in excluded.items()) or "no site result arrived"
        parts.append(f"model unchanged, round {row['round'] - 1}'s kept ({why})")
    elif weights:
        parts.append("model updated, weights " + " ".join(f"{k} {v:.2f}" for k, v in sorted(weights.items())))
    return "  ".join(parts)


def _fresh_rows(workspace: Path, since: float) -> list[dict]:
    """The metric rows the server wrote in this run so far (none from earlier runs; [] while the file
    is being written)."""
    import json

    hits = [p for p in workspace.rglob(METRICS_JSON) if p.stat().st_mtime >= since]
    if not hits:
        return []
    try:
        return list(json.loads(max(hits, key=lambda p: p.stat().st_mtime).read_text()).get("rounds", []))
    except (OSError, ValueError):
        return []


def run_simulator_with_progress(
    job_dir: Path, workspace: Path, n_clients: int, log_path: Path, poll_s: float = 2.0
) -> int:
    """Run the simulator with its logs in ``log_path`` and print one line per finished round."""
    cmd = simulator_command(job_dir, workspace, n_clients)
    num_rounds = job_num_rounds(job_dir)
    print("$ nvflare simulator", " ".join(cmd[4:]), flush=True)
    print(f"simulator log: {log_path}", flush=True)
    since = time.time() - 1.0
    shown: set[int] = set()
    with streamed_log(log_path) as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=pinned_env())
        while True:
            rc = proc.poll()
            # a round's line once its model is scored (the sites score it when the next round starts,
            # the last one at the end), or when the run has ended
            for row in _fresh_rows(workspace, since):
                t = row.get("round", 0)
                if t >= 1 and t not in shown and (_has_scores(row) or rc is not None):
                    print(format_progress(row, num_rounds), flush=True)
                    shown.add(t)
            if rc is not None:
                return rc
            time.sleep(poll_s)


def _server_config(job_dir: Path) -> dict:
    """The server app's ``config_fed_server.json`` of the job folder ``job_dir`` ({} if none)."""
    import json

    try:
        deploy_map = json.loads((job_dir / "meta.json").read_text()).get("deploy_map") or {}
    except (OSError, ValueError):
        deploy_map = {}
    apps = [app for app, sites in deploy_map.items() if {"server", "@ALL"} & set(sites)] or ["app"]
    for app in apps:
        path = job_dir / app / "config" / "config_fed_server.json"
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except ValueError:
                return {}
    return {}


def job_min_clients(job_dir: Path) -> tuple[int, str] | None:
    """The most sites the job ``job_dir`` waits for, and where it says so (its ``meta.json`` or a
    workflow's ``min_clients``); None when it names no number."""
    import json

    found: list[tuple[int, str]] = []
    try:
        meta_min = json.loads((job_dir / "meta.json").read_text()).get("min_clients")
    except (OSError, ValueError):
        meta_min = None
    if isinstance(meta_min, int):
        found.append((meta_min, "meta.json min_clients"))
    for workflow in _server_config(job_dir).get("workflows", []):
        value = (workflow.get("args") or {}).get("min_clients")
        if isinstance(value, int):
            found.append((value, f"workflow {workflow.get('id', '?')!r} min_clients"))
    return max(found) if found else None


def is_fedweigh_job(job_dir: Path) -> bool:
    """Whether the job's server runs the fedweigh controller (which writes the metrics the demo shows)."""
    return any(
        str(w.get("path", "")).startswith("fedweigh.") for w in _server_config(job_dir).get("workflows", [])
    )


def job_num_rounds(job_dir: Path) -> int | None:
    """The job's number of rounds: its controller's ``num_rounds``, else the controller's default."""
    import importlib
    import inspect

    for workflow in _server_config(job_dir).get("workflows", []):
        rounds = (workflow.get("args") or {}).get("num_rounds")
        if isinstance(rounds, int):
            return rounds
        module, _, name = str(workflow.get("path", "")).rpartition(".")
        try:  # NVFlare writes only the arguments that differ from the class's defaults
            default = inspect.signature(getattr(importlib.import_module(module), name)).parameters[
                "num_rounds"
            ]
        except (ImportError, AttributeError, KeyError, ValueError):
            continue
        if isinstance(default.default, int):
            return default.default
    return None


def check_demo_clients(job_dir: Path, clients: int) -> None:
    """A ValueError naming the job's min_clients when ``clients`` sites are fewer (NVFlare would
    end with ``min_responses ... must be less than length of targets`` in a log)."""
    needed = job_min_clients(job_dir)
    if needed is None or clients >= needed[0]:
        return
    fix = f"run it with --clients {needed[0]}"
    if (_repo_jobs_dir() / job_dir.name).is_dir():
        fix += (
            f", or export it for {clients} sites: fedweigh jobs export --min-clients {clients} --out my_jobs "
            f"{job_dir.name} and run fedweigh demo --job my_jobs/{job_dir.name} --clients {clients}"
        )
    raise ValueError(
        f"--clients {clients}: job {job_dir.name} needs at least {needed[0]} sites ({needed[1]}); {fix}"
    )


def _client_args_of(job_dir: Path):
    """The fedweigh client arguments of an exported job (its ``task_script_args``)."""
    import json

    from fedweigh.site.args import parse_args

    config = json.loads((job_dir / "app" / "config" / "config_fed_client.json").read_text())
    for executor in config.get("executors", []):
        argv = (executor.get("executor", {}).get("args") or {}).get("task_script_args")
        if argv is not None:
            return parse_args(str(argv).split())
    raise ValueError(f"{job_dir}: the job's client config names no fedweigh client arguments")


def youden_report(job_dir: Path, model_path: Path, n_clients: int) -> dict:
    """GM of the final global model on the test set at 0.5 and at per-finding Youden thresholds.

    The thresholds maximise Youden's J = TPR - FPR on the union of the sites' validation splits
    (never the test set), as ``fedweigh bench --threshold youden`` does. Returns ``gm_05``,
    ``gm_youden``, ``thresholds`` ({finding: threshold}), ``val_images`` and ``at_default`` (findings
    without both labels in validation, left at 0.5); ValueError when the job's
    task is not multi-label (multi-class GM uses the arg-max, no threshold).
    """
    import numpy as np
    import torch

    from fedweigh.data.base import LabeledImages
    from fedweigh.metrics import geometric_mean, youden_thresholds
    from fedweigh.site.data_config import resolve_site_data
    from fedweigh.site.trainer import build_site_model
    from fedweigh.train import predict, set_params

    args = _client_args_of(job_dir)
    splits = [resolve_site_data(f"site-{k}", args) for k in range(1, n_clients + 1)]
    test = splits[0][1]
    if test.task != "multilabel":
        raise ValueError(f"the {args.dataset} task is {test.task}: its GM uses the arg-max, not a threshold")
    val = LabeledImages(
        images=np.concatenate([site.val.images for site, _, _ in splits]),
        labels=np.concatenate([site.val.labels for site, _, _ in splits]),
        class_names=test.class_names,
        task=test.task,
    )
    state = torch.load(model_path, map_location="cpu", weights_only=False)
    state = state.get("model", state) if isinstance(state, dict) else state
    model = build_site_model(args, test)
    set_params(model, state)
    thresholds = youden_thresholds(val.labels, predict(model, val))
    test_scores = predict(model, test)
    return {
        "gm_05": geometric_mean(test.labels, test_scores, 0.5)[0],
        "gm_youden": geometric_mean(test.labels, test_scores, thresholds)[0],
        "thresholds": dict(zip(test.class_names, (float(t) for t in thresholds), strict=True)),
        "val_images": len(val),
        # findings the validation images do not show both ways keep 0.5 (youden_thresholds' default)
        "at_default": [
            name
            for name, column in zip(test.class_names, val.labels.T, strict=True)
            if len(np.unique(column[~np.isnan(column)])) < 2
        ],
    }


def format_youden(report: dict, width: int = 100) -> str:
    """The demo's lines on GM at the Youden thresholds: both GMs, where the thresholds come from, and
    the thresholds (a finding and its threshold never split across lines)."""
    values = sorted(report["thresholds"].values())
    default = report.get("at_default") or []
    lines = [
        f"GM {report['gm_youden']:.4f} at per-finding Youden thresholds; GM {report['gm_05']:.4f} at threshold 0.5",
        f"  thresholds: max TPR - FPR on the sites' {report['val_images']} validation images, never the test set",
    ]
    if default:
        lines.append(f"  0.5 for {len(default)} finding(s) validation shows only one way")
    current = f"  {values[0]:.3f}..{values[-1]:.3f}:"
    for name, t in report["thresholds"].items():
        item = f" {name} {t:.3f}"
        if len(current) + len(item) > width:
            lines.append(current)
            current = "   "
        current += item
    lines.append(current)
    return "\n".join(lines)


def cmd_demo(args: argparse.Namespace) -> int:
    from fedweigh.server.records import load_rows

    job_dir = Path(args.job) if args.job else _repo_jobs_dir() / DEFAULT_DEMO_JOB
    if not args.job and not (job_dir / "meta.json").is_file():
        # installed outside a source checkout (no jobs/ folder): export the demo job from its recipe
        from fedweigh.flare.jobs import export_jobs

        job_dir = export_jobs(Path("workspaces") / "jobs", [DEFAULT_DEMO_JOB])[0].resolve()
        print(
            f"no jobs/{DEFAULT_DEMO_JOB} here (fedweigh runs outside its source checkout): exported it to {job_dir}"
        )
    if not (job_dir / "meta.json").is_file():
        print(f"error: {job_dir} is not an NVFlare job folder (no meta.json); run `fedweigh jobs export`")
        return 2
    check_demo_clients(job_dir, args.clients)
    workspace = Path(args.workspace or f"workspaces/demo_{job_dir.name}").resolve()
    log_path = workspace.parent / f"{workspace.name}.log"
    start = time.perf_counter()
    if args.show_logs:
        rc = run_simulator(job_dir, workspace, args.clients)
    else:
        rc = run_simulator_with_progress(job_dir, workspace, args.clients, log_path)
    wall = time.perf_counter() - start
    app = find_server_app_dir(workspace)
    where = workspace if args.show_logs else log_path
    if rc != 0:
        print(f"error: the simulator run failed (exit code {rc}); see {where}")
        return rc
    if app is None and not is_fedweigh_job(job_dir):
        print(
            f"{job_dir.name}: the simulator run finished (exit code 0) in {wall:.0f} s. It is not a fedweigh "
            f"job (its server runs no fedweigh controller), so there is no fedweigh round table; its "
            f"results are in {workspace} and its log in {where}"
        )
        return 0
    if app is None:
        print(
            f"error: the simulator ended (exit code 0) but the fedweigh controller wrote no {METRICS_JSON}; "
            f"see {where}"
        )
        return 1
    rows = load_rows(app / METRICS_JSON)
    num_rounds = job_num_rounds(job_dir)
    print()
    print(f"{job_dir.name}: global model by round (simulator, {args.clients} sites, {wall:.0f} s)")
    print(format_round_table(rows))
    final = rows[-1] if rows else {}
    if "test_auc" in final:
        print(
            f"\nfinal test macro AUC {final['test_auc']:.4f}; GM {final.get('test_gm', float('nan')):.4f} at "
            "threshold 0.5 (geometric mean of sensitivity and specificity; with rare findings few "
            "probabilities reach 0.5, so GM at 0.5 stays low while AUC, which needs no threshold, ranks "
            "the model)"
        )
    # the model the table's last row scores: the final global model (not NVFlare's best-model pick)
    final_model = app / FINAL_MODEL if (app / FINAL_MODEL).is_file() else None
    if final_model is None:
        final_model = next(iter(sorted(workspace.rglob(FINAL_MODEL))), None)
    if "test_auc" in final and final_model is not None:
        try:
            report = youden_report(job_dir, final_model, args.clients)
        except Exception as e:  # the run's result stands; say why this extra score is missing
            print(f"GM at Youden thresholds: not computed ({type(e).__name__}: {e})")
        else:
            print(format_youden(report))
            _replot_with_youden(app, rows, (final["round"], report["gm_youden"]))
    print(f"metrics:  {app / METRICS_JSON} (and {METRICS_CSV})")
    for plot in (WEIGHTS_PLOT, AUC_PLOT):
        if (app / plot).is_file():
            print(f"plot:     {app / plot}")
    if final_model is not None:
        of = f" of {num_rounds}" if num_rounds else ""
        print(
            f"model:    {final_model} (the global model after round {final.get('round', '?')}{of}, the table's last row)"
        )
    best = next(iter(sorted(workspace.rglob(BEST_MODEL))), None)
    if best is not None:
        print(f"best:     {best} (NVFlare's model selector: the global model with the sites' best val_auc)")
    print(f"tensorboard: tensorboard --logdir {workspace}")
    print(
        "rounds:   round t is the global model after t aggregations (0: the initial model); NVFlare's logs count from 0"
    )
    return 0


#: The final global model NVFlare's persistor saves, and its best-model pick (by the key metric).
FINAL_MODEL = "FL_global_model.pt"
BEST_MODEL = "best_FL_global_model.pt"


def _replot_with_youden(app: Path, rows: list[dict], youden: tuple[int, float]) -> None:
    """Redraw the run's metric plot with the final model's GM at the Youden thresholds."""
    import json

    from fedweigh.server.records import RoundRecorder

    try:
        scheme = json.loads((app / METRICS_JSON).read_text()).get("scheme", "")
    except (OSError, ValueError):
        scheme = ""
    RoundRecorder(app, scheme, rows).plot(youden=youden)


def cmd_jobs_export(args: argparse.Namespace) -> int:
    from fedweigh.flare.jobs import export_jobs

    changed = {
        flag: value
        for flag, value in (
            ("--min-clients", args.min_clients),
            ("--rounds", args.rounds),
            ("--scenario", args.scenario),
            ("--arch", args.arch),
            ("--size", args.size),
        )
        if value is not None
    }
    if changed and args.out is None:
        flag, value = next(iter(changed.items()))
        raise ValueError(
            f"{flag} {value} needs --out DIR: {_repo_jobs_dir()} holds the catalogue's "
            "own jobs, which the tests compare with a fresh export"
        )
    out = args.out or str(_repo_jobs_dir())
    for path in export_jobs(
        out,
        args.names or None,
        bundle=args.bundle,
        site_installed=args.site_installed,
        min_clients=args.min_clients,
        num_rounds=args.rounds,
        scenario=args.scenario,
        arch=args.arch,
        size=args.size,
    ):
        print(f"exported {path}")
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def cmd_site_check(args: argparse.Namespace) -> int:
    """Check a site's data config (and with --load, read its data) before the site starts."""
    from fedweigh.site.data_config import SiteDataConfig, find_site_config, load_site_from_config

    path = Path(args.config) if args.config else find_site_config(args.workspace)
    if path is None:
        raise FileNotFoundError(
            "no site data config: give its path, or run from the site's kit folder (local/fedweigh_site.json)"
        )
    cfg = SiteDataConfig.from_file(path)
    if not args.load:
        print(f"{path}: valid ({cfg.dataset}, {cfg.size} px); its data not read (--load reads them)")
        return 0
    try:  # "valid" only once the data it names have been read: never "valid" and then an error
        site, test = load_site_from_config(args.site_name, cfg)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: the data it names cannot be read: {e}") from e
    print(f"{path}: valid ({cfg.dataset}, {cfg.size} px)")
    print(
        f"{args.site_name}: {len(site.train)} training and {len(site.val)} validation images, "
        f"{len(test)} test images, {site.train.num_classes} classes ({site.train.task})"
    )
    return 0


def cmd_scenarios(args: argparse.Namespace) -> int:
    from fedweigh.data.scenarios import scenario_table

    print(scenario_table())
    return 0


def cmd_policy(args: argparse.Namespace) -> int:
    import json

    from fedweigh.site.policy import load_site_policy

    try:
        policy = load_site_policy(args.kit)
    except (OSError, ValueError) as e:
        print(f"error: {e}")
        return 2
    print(f"site policy: {policy.source}")
    print(json.dumps(policy.as_dict(), indent=2))
    return 0


#: The sub-commands whose parsers import torch, MONAI or the bench (seconds): built only when named.
HEAVY_COMMANDS = {
    "explain": "gradient attention-rollout heatmaps of a ViT global model on test images (PNG)",
    "bench": "compare weighting methods across the client-partition scenarios (docs/bench.md)",
}


def _command_of(argv: list[str]) -> str | None:
    """The sub-command named in ``argv`` (its first word that is not an option), if any."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``fedweigh`` parser. With ``argv``, only the sub-command it names gets its full parser
    among :data:`HEAVY_COMMANDS` (the others are listed by name and help), so that ``fedweigh --help``,
    ``--version`` and the light commands never import torch or MONAI; without, every parser is full."""
    p = argparse.ArgumentParser(prog="fedweigh", description=__doc__)
    p.add_argument("--version", action="version", version=f"fedweigh {package_version()}")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo", help="run the demo job in the NVFlare simulator and print per-round metrics"
    )
    demo.add_argument("--job", help=f"job folder (default: jobs/{DEFAULT_DEMO_JOB})")
    demo.add_argument("--workspace", help="simulator workspace (default: workspaces/demo_<job>)")
    demo.add_argument("--clients", type=int, default=4)
    demo.add_argument(
        "--show-logs",
        action="store_true",
        help="stream the simulator's logs instead of one line per round (default: logs go to a file)",
    )
    demo.set_defaults(func=cmd_demo)

    jobs = sub.add_parser("jobs", help="job folders")
    jobs_sub = jobs.add_subparsers(dest="jobs_command", required=True)
    export = jobs_sub.add_parser("export", help="regenerate job folders from the recipes")
    export.add_argument("names", nargs="*", help="job names (default: all)")
    export.add_argument("--out", default=None, help="output folder (default: the checkout's jobs/)")
    export.add_argument(
        "--min-clients",
        type=_positive_int,
        default=None,
        metavar="N",
        help="sites each job waits for and needs per round (default: the catalogue's, 4); "
        "e.g. 3 for the shipped 3-hospital project; needs --out",
    )
    export.add_argument(
        "--rounds", type=_positive_int, default=None, metavar="N", help="training rounds; needs --out"
    )
    export.add_argument(
        "--scenario", default=None, help="client-partition scenario (`fedweigh scenarios`); needs --out"
    )
    export.add_argument(
        "--arch", default=None, help="network: densenet_compact, densenet121 or vit; needs --out"
    )
    export.add_argument(
        "--size", type=_positive_int, default=None, metavar="PX", help="image side in pixels; needs --out"
    )
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

    site = sub.add_parser("site", help="a deployed site's settings")
    site_sub = site.add_subparsers(dest="site_command", required=True)
    check = site_sub.add_parser(
        "check", help="check a site's data config (local/fedweigh_site.json) before the site starts"
    )
    check.add_argument(
        "config", nargs="?", help="the config file (default: FEDWEIGH_SITE_CONFIG or ./local/)"
    )
    check.add_argument("--workspace", help="the site's kit folder to look for local/fedweigh_site.json in")
    check.add_argument("--load", action="store_true", help="also read the data it names")
    check.add_argument("--site-name", default="site", help="the site's name in the messages (with --load)")
    check.set_defaults(func=cmd_site_check)

    policy = sub.add_parser(
        "policy",
        help="show the privacy policy a site runs under (its local/fedweigh_policy.json or the default)",
    )
    policy.add_argument("kit", nargs="?", default=None, help="the site's startup kit folder (default: here)")
    policy.set_defaults(func=cmd_policy)

    scen = sub.add_parser("scenarios", help="list the client-partition scenarios")
    scen.set_defaults(func=cmd_scenarios)

    command = None if argv is None else _command_of(argv)
    for name, help_text in HEAVY_COMMANDS.items():
        if argv is not None and command != name:
            sub.add_parser(name, help=help_text)
        elif name == "explain":
            from fedweigh.explain.command import add_explain_parser

            add_explain_parser(sub)
        else:
            from fedweigh.bench.cli import add_bench_parser

            add_bench_parser(sub)
    return p


def error_line(exc: BaseException) -> str:
    """``error: <message>`` on one line (a KeyError's message without its quotes)."""
    message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    message = " ".join(str(message).split()) or type(exc).__name__
    return f"error: {message}"


def main(argv: list[str] | None = None) -> int:
    """Run the command; an error prints one line (``--debug`` shows the traceback) and returns 2."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(error_line(exc), file=sys.stderr)
        print("(run with --debug for the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
