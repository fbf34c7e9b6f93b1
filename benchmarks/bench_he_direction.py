"""Under HE, the direction check of the sites' guard: its statistic on honest rounds and against a site
that sends its own update negated (and boosted).

    cd <checkout> && PYTHONPATH=custom nice -n 10 .venv/bin/python benchmarks/bench_he_direction.py \\
        [--parts honest,without,with] [--workers 2] [--out docs/results/he-direction/he_direction.json]
    .venv/bin/python benchmarks/bench_he_direction.py --markdown docs/results/he-direction/he_direction.json

Everything runs in this process (and its workers) with the code the NVFlare client and controller run
under HE, as the attack suite's HE transport (fedweigh.bench.he_sites): ``SiteTrainer``, ``HEModelGuard`` (receive, clip, encode),
``decrypt_global`` / ``encode_update``, the server's ``RoundStep`` with ``EncryptedGlobalModel``.
Settings: SynthCXR at 32 px, the compact DenseNet, 10 local Adam steps per round, 4 sites, ``ROUNDS``
training rounds plus the final model's delivery (judged too).

- ``honest``: the scenarios of the HE bench (iid-4, FedAvg) and of the shipped HE job
  (``synthcxr_feddraw_he``: quantity-shift, FedDRAW), several seeds: per honest site and round the
  direction statistics cos_own = cos(Delta_g, Delta_own), cos_trend = cos(Delta_g, m) and their
  maximum (what :data:`fedweigh.site.he_guard.DIRECTION_BOUND` bounds), and the rounds refused.
- ``without`` / ``with``: site-4 sends ``factor`` x its own update (factor -1, -2, -3, -4: negated and
  boosted) in every round, the sites' guard without the direction check (the statistics measured,
  nothing refused on them) and with it: rounds the honest sites refused, and the AUC of the model
  honest site-1 holds after the last round (the model it accepted last) on the test set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "custom"))

SITES = ("site-1", "site-2", "site-3", "site-4")
ATTACKER = "site-4"
ROUNDS = 6
SEEDS = (0, 1, 2)
#: (scenario, scheme): the HE bench's and the shipped HE job's
HONEST = (("iid-4", "fedavg"), ("quantity-shift", "feddraw"))
#: longer honest runs (``honest-long``): LONG_ROUNDS rounds, these seeds
LONG_ROUNDS = 10
LONG_SEEDS = (0, 1)
FACTORS = (-1.0, -2.0, -3.0, -4.0)
#: (scenario, scheme, seed) of the attack runs
ATTACK_SETTINGS = (("iid-4", "fedavg", 0),)
OUT = ROOT / "docs" / "results" / "he-direction" / "he_direction.json"


def run_federation(
    scenario: str, scheme: str, seed: int, factor: float | None, direction: bool, rounds: int = ROUNDS
) -> dict:
    """One HE federation of 4 sites (site-4 sends ``factor`` x its own update in every round; None: honest)
    with every site's :class:`HEModelGuard` (``direction=False``: direction measured, not judged)."""
    import torch

    torch.set_num_threads(1)
    from fedweigh.data import build_federation
    from fedweigh.protocol import META_MIN_SECURE_SUM, META_NUM_SAMPLES, META_NUM_STEPS, META_SCALARS
    from fedweigh.secure.contexts import context_from_bytes, make_context, serialize_context
    from fedweigh.secure.updates import decrypt_global, encode_update
    from fedweigh.server.encrypted import EncryptedGlobalModel
    from fedweigh.server.quorum import server_floor
    from fedweigh.server.rounds import ClientResult, RoundStep
    from fedweigh.server.safeguards import Safeguards
    from fedweigh.site.args import ClientArgs
    from fedweigh.site.he_guard import DIRECTION_BOUND, HEModelGuard
    from fedweigh.site.policy import PROVISIONED_DEFAULT
    from fedweigh.site.trainer import SiteTrainer, build_site_model
    from fedweigh.train import evaluate, get_params, set_params
    from fedweigh.weighting import get_scheme

    start = time.perf_counter()
    args = ClientArgs(
        dataset="synthcxr",
        scenario=scenario,
        num_images=1200,
        size=32,
        max_steps=10,
        batch_size=16,
        threads=1,
        seed=seed,
    )
    fed = build_federation(scenario, "synthcxr", size=32, seed=seed, num_images=1200)
    secret = make_context()
    public = context_from_bytes(serialize_context(secret, with_secret_key=False), role="server")
    trainers = {s.name: SiteTrainer(s, fed.test, args, threads=1) for s in fed.sites}
    scorer = build_site_model(args, fed.test)
    g0 = get_params(scorer)
    backend = EncryptedGlobalModel(public, g0)
    step = RoundStep(
        get_scheme(scheme),
        backend,
        num_rounds=rounds,
        safeguards=Safeguards(min_clients=2, min_secure_sum=server_floor(3, len(SITES))),
        log=lambda m: None,
    )
    bound = DIRECTION_BOUND if direction else None
    guards = {s: HEModelGuard(s, direction_bound=bound) for s in trainers}
    held: dict[str, dict] = {}
    stats, refused, notes, weights = [], [], [], []
    for t in range(1, rounds + 2):  # round rounds + 1: the final model's delivery
        received = backend.task_params()
        meta = backend.meta()
        plan = step.plan(scheme, {})
        results, refusing = [], 0
        for site, trainer in trainers.items():
            decrypted = decrypt_global(secret, received, meta, g0, PROVISIONED_DEFAULT.min_secure_sum)
            receipt = guards[site].receive(decrypted, t, meta.get("steps"))
            d = guards[site].direction
            honest_site = site != ATTACKER or factor is None  # an honest run: every site counts
            if honest_site and d:
                known = [c for c in d.values() if c is not None]
                stats.append(
                    {
                        "round": t,
                        "site": site,
                        "cos_own": d["cos_own"],
                        "cos_trend": d["cos_trend"],
                        "judged": max(known) if known else None,
                        "refused": receipt.refusal is not None,
                    }
                )
            if receipt.refusal and honest_site:
                refusing += 1
                notes.append(receipt.refusal.split(": ", 1)[-1][:200])
            held[site] = receipt.use
            if t > rounds:
                continue
            out = trainer.run_round(receipt.use, t - 1, plan, total_rounds=rounds, evaluate_received=False)
            keys = decrypted.layout.keys
            outgoing = guards[site].outgoing(out.params, receipt, keys, out.num_steps)
            if site == ATTACKER and factor is not None:  # factor x the update it would send
                outgoing = dict(outgoing)
                for k in keys:
                    r = np.asarray(receipt.received[k], np.float64)
                    sent = r + factor * (np.asarray(outgoing[k], np.float64) - r)
                    outgoing[k] = sent.astype(np.asarray(outgoing[k]).dtype)
            params = encode_update(secret, outgoing, receipt.received, decrypted.layout, check=receipt.check)
            site_meta = {
                META_NUM_SAMPLES: out.num_samples,
                META_NUM_STEPS: out.num_steps,
                META_SCALARS: out.scalars,
                META_MIN_SECURE_SUM: PROVISIONED_DEFAULT.min_secure_sum,
            }
            results.append(ClientResult(site, params, site_meta, out.metrics))
        if refusing:
            refused.append(t)
        if t > rounds:
            break
        outcome = step.run(t, results, list(SITES))
        weights.append({k: round(float(v), 4) for k, v in (getattr(outcome, "weights", None) or {}).items()})
    set_params(scorer, held["site-1"])
    auc = float(evaluate(scorer, fed.test)["auc"])
    return {
        "scenario": scenario,
        "scheme": scheme,
        "seed": seed,
        "factor": factor,
        "rounds": rounds,
        "direction_check": direction,
        "direction_bound": bound,
        "refused_rounds": refused,
        "refusals": sorted(set(notes))[:6],
        "auc": round(auc, 4),
        "stats": stats,
        "weights": weights,
        "seconds": round(time.perf_counter() - start, 1),
    }


def _job(spec: tuple) -> dict:
    with tempfile.TemporaryDirectory() as work:
        os.chdir(work)
        return run_federation(*spec)


def _quantiles(values: list[float]) -> dict:
    a = np.asarray([v for v in values if v is not None], np.float64)
    if not a.size:
        return {"n": 0}
    return {
        "n": int(a.size),
        "min": round(float(a.min()), 4),
        "p05": round(float(np.quantile(a, 0.05)), 4),
        "median": round(float(np.median(a)), 4),
        "max": round(float(a.max()), 4),
    }


def summarize(record: dict) -> dict:
    """The honest distribution of the statistics and rounds refused, and per attack factor the rounds
    refused and AUC without / with the direction check."""
    honest = record.get("honest", [])
    every = honest + record.get("honest-long", [])
    stats = [s for r in every for s in r["stats"]]
    out: dict = {
        "honest": {
            "runs": len(every),
            "rounds_judged": len(stats),
            "rounds_refused": sum(len(r["refused_rounds"]) for r in every),
            "judged": _quantiles([s["judged"] for s in stats]),
            "cos_own": _quantiles([s["cos_own"] for s in stats]),
            "cos_trend": _quantiles([s["cos_trend"] for s in stats]),
        },
        "attacks": [],
    }
    for sc, sch, seed in ATTACK_SETTINGS:
        clean = [r for r in honest if (r["scenario"], r["scheme"], r["seed"]) == (sc, sch, seed)]
        for factor in FACTORS:
            row: dict = {"scenario": sc, "scheme": sch, "seed": seed, "factor": factor}
            row["clean_auc"] = clean[0]["auc"] if clean else None
            for part in ("without", "with"):
                runs = [
                    r
                    for r in record.get(part, [])
                    if (r["scenario"], r["scheme"], r["seed"], r["factor"]) == (sc, sch, seed, factor)
                ]
                if runs:
                    r = runs[0]
                    row[part] = {
                        "refused_rounds": r["refused_rounds"],
                        "auc": r["auc"],
                        "judged": _quantiles([x["judged"] for x in r["stats"]]),
                    }
            out["attacks"].append(row)
    return out


def markdown_table(record: dict) -> str:
    """The summary of a results JSON as a table (what docs show)."""
    s = record["summary"]
    h = s["honest"]
    lines = [
        f"Honest: {h['runs']} runs, {h['rounds_judged']} site-rounds judged, {h['rounds_refused']} rounds refused; "
        f"max(cos_own, cos_trend) min {h['judged'].get('min')}, 5th percentile {h['judged'].get('p05')}, "
        f"median {h['judged'].get('median')}; bound {record['settings']['direction_bound']}",
        "",
        "| scenario (scheme) | site-4 sends | rounds refused without | AUC without | rounds refused with "
        "| AUC with | clean AUC |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in s["attacks"]:
        wo, wi = row.get("without"), row.get("with")
        if not wo or not wi:
            continue
        clean = "-" if row["clean_auc"] is None else f"{row['clean_auc']:.4f}"
        lines.append(
            f"| {row['scenario']} ({row['scheme']}) | {row['factor']:+g} x its update "
            f"| {', '.join(map(str, wo['refused_rounds'])) or '-'} | {wo['auc']:.4f} "
            f"| {', '.join(map(str, wi['refused_rounds'])) or '-'} | {wi['auc']:.4f} | {clean} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="honest,honest-long,without,with")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--markdown", default=None, help="print the table of a results JSON and exit")
    ns = parser.parse_args(argv)
    if ns.markdown:
        print(markdown_table(json.loads(Path(ns.markdown).read_text())))
        return 0
    os.environ.setdefault("FEDWEIGH_CACHE", str(Path(tempfile.gettempdir()) / "fedweigh-bench-cache"))
    from fedweigh.site.he_guard import DIRECTION_BOUND, TREND_DECAY

    parts = [p for p in ns.parts.split(",") if p]
    specs = []
    for part in parts:
        if part == "honest":
            specs += [(part, (sc, sch, seed, None, True)) for sc, sch in HONEST for seed in SEEDS]
        elif part == "honest-long":
            specs += [
                (part, (sc, sch, seed, None, True, LONG_ROUNDS)) for sc, sch in HONEST for seed in LONG_SEEDS
            ]
        else:
            specs += [
                (part, (sc, sch, seed, f, part == "with"))
                for sc, sch, seed in ATTACK_SETTINGS
                for f in FACTORS
            ]
    out = Path(ns.out)
    record = json.loads(out.read_text()) if out.exists() else {}
    for part in parts:
        record[part] = []
    with ProcessPoolExecutor(ns.workers) as pool:
        for (part, _), result in zip(specs, pool.map(_job, [s for _, s in specs]), strict=True):
            record[part].append(result)
            print(
                f"{part:8} {result['scenario']:15} {result['scheme']:8} seed {result['seed']} factor "
                f"{result['factor']} refused {result['refused_rounds']} AUC {result['auc']:.4f} "
                f"({result['seconds']:.0f} s)",
                flush=True,
            )
    record["settings"] = {
        "dataset": "synthcxr",
        "num_images": 1200,
        "size": 32,
        "max_steps": 10,
        "batch_size": 16,
        "sites": list(SITES),
        "attacker": ATTACKER,
        "rounds": ROUNDS,
        "seeds": list(SEEDS),
        "long_rounds": LONG_ROUNDS,
        "long_seeds": list(LONG_SEEDS),
        "honest": [list(h) for h in HONEST],
        "attack_settings": [list(a) for a in ATTACK_SETTINGS],
        "factors": list(FACTORS),
        "direction_bound": DIRECTION_BOUND,
        "trend_decay": TREND_DECAY,
        "python": sys.version.split()[0],
    }
    record["command"] = (
        "PYTHONPATH=custom nice -n 10 .venv/bin/python benchmarks/bench_he_direction.py --parts " + ns.parts
    )
    record["summary"] = summarize(record)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(markdown_table(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
