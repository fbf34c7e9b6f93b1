"""One run per attack against a 4-site federation: did the job complete, was the attacking site left
out (or its update bounded) and why, and the final test AUC against the same job without the attack.

    cd <checkout> && PYTHONPATH=custom .venv/bin/python benchmarks/bench_attacks.py \\
        --out docs/security/attacks.json

Setting: SynthCXR, scenario iid-4 (4 sites, 270 training images each, 240 test images), 32 px,
the compact DenseNet, 5 rounds of 10 local Adam steps (batch 16); site-4 attacks in every round
(from round 2 for the replay, in round 2 for the silent and crashing site). Every run uses the
defaults a job gets: the round step's checks, the weight cap (``max_share="auto"``), the update
norm bound (3 x the median of the others), the server's secure-sum quorum (3 of 4) and the sites'
default provisioned policy (they decrypt no sum of fewer than 3 contributions).

Paths (the column ``path``):

- ``round step``: in this process, the server's :class:`fedweigh.server.rounds.RoundStep` (the code the
  NVFlare controller runs) with four :class:`fedweigh.site.trainer.SiteTrainer`; the attacker's result is
  altered after honest training. ``round step (HE)``: the same with the CKKS backend
  (:class:`fedweigh.server.encrypted.EncryptedGlobalModel`) and TenSEAL keys made here.
- ``statistics phase``: in this process, the secure label-statistics exchange the controller runs
  (:func:`fedweigh.server.label_stats.sum_statistics` with :class:`fedweigh.secure.exchange.SecureExchange`
  at the server, each site's quorum check before decrypting), then the rounds as above (DAFL, whose
  loss uses the global histogram).
- ``simulator``: ``nvflare simulator`` with the job's real transport, the fedweigh controller and
  client script; benchmarks/attack_client.py replaces site-4's entry script. Used where the attack
  is on the transport itself: a silent site (the server waits ``train_timeout``) and a crashing one.

AUC drop = clean AUC - attacked AUC of the global model after the last round, on the test set, against
the clean run of the same method and path. Last, the cost of the defaults without any attacker:
FedAvg on skewed federations (quantity skew, label skew) with the defaults and with the weight cap,
norm bound and direction check off. "Crashed or stalled": the job did not finish, or a
training round left the global model unchanged. The last line reads
``attacks: N tried, C crashed or stalled, worst AUC drop D``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from fedweigh.data import build_federation
from fedweigh.histograms import META_LENGTH, META_NUM_CONTRIBUTIONS, decode_sum, statistics_vector
from fedweigh.protocol import META_MIN_SECURE_SUM, META_NUM_SAMPLES, META_NUM_STEPS, META_SCALARS
from fedweigh.server.label_stats import sum_statistics
from fedweigh.server.quorum import server_floor
from fedweigh.server.rounds import ClientResult, PlaintextBackend, RoundStep
from fedweigh.server.safeguards import Safeguards
from fedweigh.site.args import ClientArgs
from fedweigh.site.policy import PROVISIONED_DEFAULT
from fedweigh.site.trainer import SiteTrainer, build_site_model
from fedweigh.train import evaluate, get_params, set_params
from fedweigh.weighting import get_scheme

ATTACKER = "site-4"
SITES = ("site-1", "site-2", "site-3", "site-4")
ROUNDS = 5
ARGS = ClientArgs(
    dataset="synthcxr", scenario="iid-4", num_images=1200, size=32, max_steps=10, batch_size=16, threads=1
)
#: The sites' policy: a provisioned hospital's default (decrypts no secure sum of fewer than 3).
SITE_MIN = PROVISIONED_DEFAULT.min_secure_sum
#: The server's quorum: the controller's default min_secure_sum (3) for a federation of 4.
SERVER_FLOOR = server_floor(3, len(SITES))
#: Simulator runs: seconds the server waits for a round's results. Round 1 includes every site's
#: start-up (four client processes on two shared cores), which must fit in it.
TRAIN_TIMEOUT = 150
SILENT_S = TRAIN_TIMEOUT + 15
#: Federations without an attacker on which the defaults' cost is measured (FedAvg, in process).
HONEST_COST = (("quantity-shift", 0), ("quantity-shift", 1), ("quantity-shift", 2), ("label-a0.5", 0))


@dataclass(frozen=True)
class Method:
    scheme: str
    scheme_args: dict = field(default_factory=dict)
    loss: str = "default"
    statistics: bool = False
    he: bool = False


METHODS = {
    "fedavg": Method("fedavg"),
    "feddraw": Method("feddraw"),
    "cbr": Method("cbr"),
    "dafl": Method("dafl", loss="dafl", statistics=True),
    "dafl-inverse": Method("dafl", {"mode": "inverse_imbalance"}, loss="dafl", statistics=True),
    "fedavg-he": Method("fedavg", he=True),
}


@dataclass(frozen=True)
class Attack:
    name: str
    kind: str
    method: str
    path: str


ATTACKS = [
    Attack("NaN parameters", "nan", "fedavg", "round step"),
    Attack("inf parameters", "inf", "fedavg", "round step"),
    Attack("huge finite update (theta_g + 1e30)", "huge", "fedavg", "round step"),
    Attack("scaled sign-flipped update (-10 x Delta)", "signflip", "fedavg", "round step"),
    Attack("wrong dtype (complex64)", "dtype", "fedavg", "round step"),
    Attack("wrong shape (a row missing)", "shape", "fedavg", "round step"),
    Attack("forged sample count (x1000)", "samples", "fedavg", "round step"),
    Attack("forged similarity 1.0 (FedDRAW)", "similarity", "feddraw", "round step"),
    Attack("forged imbalance 0 (DAFL inverse)", "imbalance", "dafl-inverse", "statistics phase"),
    Attack("forged skew 0 (CBR)", "skew", "cbr", "round step"),
    Attack("replayed round-1 update", "replay", "fedavg", "round step"),
    Attack("silent site (round 2)", "silent", "fedavg", "simulator"),
    Attack("crashing site (round 2)", "crash", "fedavg", "simulator"),
    Attack("one-site secure sum", "one-site-sum", "dafl", "statistics phase"),
    Attack("statistics vector of the wrong length", "wrong-length", "dafl", "statistics phase"),
    Attack("statistics ciphertext at the wrong scale", "stats-scale", "dafl", "statistics phase"),
    Attack("update ciphertext at the wrong scale (HE)", "he-scale", "fedavg-he", "round step (HE)"),
]


@dataclass
class RunResult:
    completed: bool
    stalled_rounds: list[int]
    notes: list[str]
    attacker_weight: float
    auc: float
    seconds: float
    error: str = ""
    #: over all sites and rounds: results left out, and updates scaled down to the norm bound
    left_out: int = 0
    bounded: int = 0


# --------------------------------------------------------------------------------------- keys
class Keys:
    """One CKKS key pair (HEBuilder's parameters) for the in-process secure paths."""

    def __init__(self):
        from fedweigh.secure.contexts import context_from_bytes, make_context, serialize_context

        self.secret = make_context()
        self.public = context_from_bytes(serialize_context(self.secret, with_secret_key=False), role="server")

    def provider(self, role: str):
        return self.secret if role == "client" else self.public


def _reencrypt_at_scale(ctx, data: bytes, scale: float) -> bytes:
    import tenseal as ts

    values = ts.ckks_vector_from(ctx, data).decrypt()
    return ts.ckks_vector(ctx, values, scale=scale).serialize()


# --------------------------------------------------------------------------------------- in process
def _tamper(
    kind: str, result: ClientResult, g: dict, t: int, memory: dict, keys: Keys | None
) -> ClientResult:
    """site-4's honest result, altered by the attack."""
    params = dict(result.params)
    meta = dict(result.meta)
    floats = [k for k, v in params.items() if np.asarray(v).dtype.kind == "f"]
    if kind == "nan":
        params[floats[0]] = np.full_like(params[floats[0]], np.nan)
    elif kind == "inf":
        params[floats[0]] = np.full_like(params[floats[0]], np.inf)
    elif kind == "huge":
        for k in floats:
            params[k] = (np.asarray(g[k], np.float64) + 1e30).astype(params[k].dtype)
    elif kind == "signflip":
        for k in floats:
            g64 = np.asarray(g[k], np.float64)
            params[k] = (g64 - 10.0 * (np.asarray(params[k], np.float64) - g64)).astype(params[k].dtype)
    elif kind == "dtype":
        params[floats[0]] = params[floats[0]].astype(np.complex64)
    elif kind == "shape":
        key = next(k for k in floats if params[k].ndim >= 2)
        params[key] = params[key][:-1]
    elif kind == "samples":
        meta[META_NUM_SAMPLES] = 1000 * int(meta[META_NUM_SAMPLES])
    elif kind in ("similarity", "imbalance", "skew"):
        meta[META_SCALARS] = {**meta.get(META_SCALARS, {}), kind: 1.0 if kind == "similarity" else 0.0}
    elif kind == "replay":
        if t == 1:
            memory["replay"] = {k: np.copy(v) for k, v in params.items()}
        else:
            params = memory["replay"]
    elif kind == "he-scale":
        from fedweigh.secure.updates import UPDATE_PREFIX, pack_chunks, unpack_chunks

        chunks, clear = unpack_chunks(params, UPDATE_PREFIX)
        chunks[0] = _reencrypt_at_scale(keys.secret, chunks[0], 2.0**30)
        params = {**pack_chunks(chunks, UPDATE_PREFIX), **clear}
    return replace(result, params=params, meta=meta)


def _statistics_phase(trainers: dict[str, SiteTrainer], kind: str | None, keys: Keys) -> list[str]:
    """The secure statistics phase as the controller and the sites run it; returns notes."""
    from fedweigh.secure.exchange import META_CIPHERTEXT, SecureExchange

    server = SecureExchange(keys.provider)
    payloads = {}
    for site, trainer in trainers.items():
        client = SecureExchange(keys.provider, SITE_MIN)
        release = trainer.released_statistics()
        vector = statistics_vector(release.class_counts, release.num_samples)
        if site == ATTACKER and kind == "wrong-length":
            vector = vector[:10]
        payload = client.encode(vector)
        if site == ATTACKER and kind == "stats-scale":
            data = base64.b64decode(payload[META_CIPHERTEXT])
            payload[META_CIPHERTEXT] = base64.b64encode(
                _reencrypt_at_scale(keys.secret, data, 2.0**30)
            ).decode()
        payloads[site] = {
            META_LENGTH: int(vector.size),
            META_NUM_SAMPLES: release.num_samples,
            META_MIN_SECURE_SUM: SITE_MIN,
            **payload,
        }
    notes = []
    if kind == "one-site-sum":  # only site-1's contribution reaches the server
        lone = payloads["site-1"]
        payloads = {"site-1": lone}
        # and a server that ignored its quorum would hand the sites site-1's ciphertext as the "sum"
        forged = {**lone, META_NUM_CONTRIBUTIONS: 1}
        refused = 0
        for _ in trainers:
            try:
                SecureExchange(keys.provider, SITE_MIN).decode(forged)
            except ValueError:
                refused += 1
        notes.append(f"{refused} of {len(trainers)} sites refused to decrypt a 1-contribution sum")
    outcome = sum_statistics(server, payloads, SERVER_FLOOR)
    if ATTACKER in outcome.excluded:
        notes.insert(0, outcome.excluded[ATTACKER])
    if outcome.total is None:
        notes.insert(0, f"server: {outcome.reason}")
        return notes
    for trainer in trainers.values():
        stats = decode_sum(SecureExchange(keys.provider, SITE_MIN).decode(outcome.total))
        trainer.global_stats = stats
    return notes


def run_in_process(fed, method_name: str, kind: str | None, keys: Keys, defences: bool = True) -> RunResult:
    from fedweigh.secure.updates import decode_global, encode_update
    from fedweigh.server.encrypted import EncryptedGlobalModel

    start = time.perf_counter()
    method = METHODS[method_name]
    args = replace(ARGS, loss=method.loss)
    trainers = {s.name: SiteTrainer(s, fed.test, args, threads=1) for s in fed.sites}
    scorer = build_site_model(args, fed.test)
    g0 = get_params(scorer)
    notes: list[str] = []
    if method.statistics:
        notes += _statistics_phase(trainers, kind, keys)
    backend = EncryptedGlobalModel(keys.public, g0) if method.he else PlaintextBackend(g0)
    scheme = get_scheme(method.scheme, **method.scheme_args)
    quorum = {"min_clients": 2, "min_secure_sum": SERVER_FLOOR}
    step = RoundStep(
        scheme,
        backend,
        num_rounds=ROUNDS,
        safeguards=Safeguards(**quorum) if defences else Safeguards.off(**quorum),
        log=lambda m: None,
    )
    memory: dict = {}
    stalled, weight = [], 0.0
    left_out = bounded = 0
    g = g0
    for t in range(1, ROUNDS + 1):
        if method.he:
            g, _ = decode_global(keys.secret, backend.task_params(), backend.meta(), g0, SITE_MIN)
        else:
            g = backend.task_params()
        plan = step.plan(method.scheme, method.scheme_args)
        results = []
        for site, trainer in trainers.items():
            out = trainer.run_round(g, t - 1, plan, total_rounds=ROUNDS)
            params = encode_update(keys.secret, out.params, g, backend.layout) if method.he else out.params
            meta = {
                META_NUM_SAMPLES: out.num_samples,
                META_NUM_STEPS: out.num_steps,
                META_SCALARS: out.scalars,
                META_MIN_SECURE_SUM: SITE_MIN,
            }
            result = ClientResult(site, params, meta, out.metrics)
            if site == ATTACKER and kind is not None:
                result = _tamper(kind, result, g, t, memory, keys)
            results.append(result)
        outcome = step.run(t, results, list(SITES))
        left_out += len(outcome.excluded)
        bounded += len(outcome.bounded)
        if not outcome.updated:
            stalled.append(t)
        for note in (outcome.excluded.get(ATTACKER), outcome.bounded.get(ATTACKER)):
            if note:
                notes.append(note)
        unasked = set(results[-1].meta.get(META_SCALARS, {})) - set(step.scalars)
        if unasked:
            notes.append(
                f"unasked scalar(s) {sorted(unasked)} dropped unread (the server computes or does not use them)"
            )
        weight = max(weight, outcome.weights.get(ATTACKER, 0.0))
    if method.he:
        final, _ = decode_global(keys.secret, backend.task_params(), backend.meta(), g0, SITE_MIN)
    else:
        final = backend.task_params()
    set_params(scorer, final)
    auc = float(evaluate(scorer, fed.test)["auc"])
    return RunResult(
        True, stalled, notes, weight, auc, time.perf_counter() - start, left_out=left_out, bounded=bounded
    )


# --------------------------------------------------------------------------------------- simulator
def run_in_simulator(kind: str | None, workdir: Path) -> RunResult:
    from fedweigh.cli import find_server_app_dir, simulator_command
    from fedweigh.flare.recipes import FedweighRecipe
    from fedweigh.server.records import load_rows

    start = time.perf_counter()
    name = f"attack_{kind or 'clean'}".replace("-", "_")
    recipe = FedweighRecipe(
        name=name, scheme="fedavg", num_rounds=ROUNDS, min_clients=2, client=ARGS, train_timeout=TRAIN_TIMEOUT
    )
    jobs = workdir / "jobs"
    recipe.export(str(jobs))
    for entry in (jobs / name).glob("app*/custom/**/fedweigh_client.py"):
        shutil.copyfile(Path(__file__).with_name("attack_client.py"), entry)
    attacks = {ATTACKER: {"2": kind}} if kind else {}
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "FEDWEIGH_ATTACK": json.dumps(attacks),
        "FEDWEIGH_ATTACK_SILENT_S": str(SILENT_S),
    }
    workspace = workdir / f"ws_{name}"
    try:
        proc = subprocess.run(
            simulator_command(jobs / name, workspace, len(SITES)),
            capture_output=True,
            text=True,
            timeout=900,
            env=env,
            cwd=workdir,
        )
    except subprocess.TimeoutExpired:
        return RunResult(
            False, [], ["the simulator ran past 900 s"], 0.0, float("nan"), time.perf_counter() - start
        )
    app = find_server_app_dir(workspace)
    if proc.returncode != 0 or app is None:
        return RunResult(
            False,
            [],
            [f"simulator exit {proc.returncode}"],
            0.0,
            float("nan"),
            time.perf_counter() - start,
            error=proc.stderr[-2000:],
        )
    rows = {r["round"]: r for r in load_rows(app / "fedweigh_metrics.json")}
    stalled = [t for t in range(1, ROUNDS + 1) if not rows.get(t, {}).get("global_updated")]
    notes = [r["excluded"][ATTACKER] for t, r in sorted(rows.items()) if ATTACKER in r.get("excluded", {})]
    for t in stalled:  # why a round left the model unchanged: every site's reason
        notes.append(f"round {t} unchanged: {rows.get(t, {}).get('excluded', 'no record')}")
    weight = max((r.get("weights", {}).get(ATTACKER, 0.0) for r in rows.values()), default=0.0)
    completed = ROUNDS in rows and "test_auc" in rows[ROUNDS]
    auc = float(rows[ROUNDS]["test_auc"]) if completed else float("nan")
    return RunResult(completed, stalled, notes, weight, auc, time.perf_counter() - start)


# --------------------------------------------------------------------------------------- report
def _why(notes: list[str]) -> str:
    """The distinct reasons (site name removed; notes that differ only in their figures, such as the
    norms of each round, counted once with the number of rounds)."""
    import re

    groups: dict[str, list[str]] = {}
    for note in notes:
        text = note.replace(f"{ATTACKER}: ", "").replace(f"{ATTACKER} ", "")
        groups.setdefault(re.sub(r"[-+]?\d[\d.e+]*", "#", text), []).append(text)
    parts = [
        texts[0] + (f" (and so in {len(texts) - 1} more round(s))" if len(texts) > 1 else "")
        for texts in groups.values()
    ]
    return "; ".join(parts) if parts else "-"


def markdown_table(record: dict) -> str:
    """The results of a run (its JSON) as the table of docs/security.md."""
    lines = [
        "| attack | path | job completed | site-4 left out or bounded, and why | largest weight of site-4 "
        "| AUC | clean AUC | AUC drop |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in record["attacks"]:
        done = "yes" if r["completed"] and not r["crashed_or_stalled"] else "NO"
        lines.append(
            f"| {r['attack']} | {r['path']} | {done} | {r['why']} | {r['attacker_max_weight']:.3f} "
            f"| {r['auc']:.4f} | {r['clean_auc']:.4f} | {r['auc_drop']:+.4f} |"
        )
    if record.get("honest_cost"):
        lines += [
            "",
            "| federation without attacker (FedAvg) | training images per site | AUC, defaults | AUC, checks "
            "off | difference | site-rounds left out / bounded |",
            "|---|---|---|---|---|---|",
        ]
        for h in record["honest_cost"]:
            lines.append(
                f"| {h['scenario']}, seed {h['seed']} | {', '.join(map(str, h['train_sizes']))} "
                f"| {h['auc_defaults']:.4f} | {h['auc_without']:.4f} | {h['difference']:+.4f} "
                f"| {h['site_rounds_left_out']} / {h['site_rounds_bounded']} |"
            )
    s = record["summary"]
    lines.append("")
    lines.append(
        f"attacks: {s['tried']} tried, {s['crashed_or_stalled']} crashed or stalled, worst AUC drop "
        f"{s['worst_auc_drop']:.4f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=None, help="JSON file for the results (e.g. docs/security/attacks.json)"
    )
    parser.add_argument("--skip-simulator", action="store_true", help="run only the in-process attacks")
    parser.add_argument(
        "--markdown", default=None, help="print the table of a results JSON and exit (no run)"
    )
    ns = parser.parse_args(argv)
    if ns.markdown:
        print(markdown_table(json.loads(Path(ns.markdown).read_text())))
        return 0
    torch.set_num_threads(1)
    os.environ.setdefault("FEDWEIGH_CACHE", str(Path(tempfile.gettempdir()) / "fedweigh-bench-cache"))
    fed = build_federation(
        ARGS.scenario, ARGS.dataset, size=ARGS.size, seed=ARGS.seed, num_images=ARGS.num_images
    )
    keys = Keys()
    attacks = [a for a in ATTACKS if not (ns.skip_simulator and a.path == "simulator")]
    clean: dict[str, RunResult] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for attack in attacks:
            reference = "simulator" if attack.path == "simulator" else attack.method
            if reference not in clean:
                clean[reference] = (
                    run_in_simulator(None, Path(tmp))
                    if reference == "simulator"
                    else run_in_process(fed, reference, None, keys)
                )
                print(
                    f"clean {reference}: AUC {clean[reference].auc:.4f} ({clean[reference].seconds:.0f} s)",
                    flush=True,
                )
            try:
                if attack.path == "simulator":
                    run = run_in_simulator(attack.kind, Path(tmp))
                else:
                    run = run_in_process(fed, attack.method, attack.kind, keys)
            except Exception as e:  # an attack that escapes every check is a crash of the job
                run = RunResult(False, [], [f"{type(e).__name__}: {e}"], 0.0, float("nan"), 0.0)
            failed = not run.completed or bool(run.stalled_rounds)
            drop = clean[reference].auc - run.auc if run.completed else float("nan")
            rows.append(
                {
                    "attack": attack.name,
                    "method": attack.method,
                    "path": attack.path,
                    "completed": run.completed,
                    "stalled_rounds": run.stalled_rounds,
                    "crashed_or_stalled": failed,
                    "why": _why(run.notes),
                    "attacker_max_weight": round(run.attacker_weight, 4),
                    "auc": round(run.auc, 4),
                    "clean_auc": round(clean[reference].auc, 4),
                    "auc_drop": round(drop, 4),
                    "seconds": round(run.seconds, 1),
                    **({"error": run.error} if run.error else {}),
                }
            )
            r = rows[-1]
            print(
                f"{attack.name:<45} {attack.path:<17} completed={r['completed']!s:<5} "
                f"weight={r['attacker_max_weight']:.3f} AUC {r['auc']:.4f} (clean {r['clean_auc']:.4f}, "
                f"drop {r['auc_drop']:+.4f})  {r['why']}",
                flush=True,
            )
    # what the defaults cost a federation without attacker: FedAvg on skewed federations, defaults on and off
    honest = []
    for scenario, seed in HONEST_COST:
        skewed = build_federation(
            scenario, ARGS.dataset, size=ARGS.size, seed=seed, num_images=ARGS.num_images
        )
        on = run_in_process(skewed, "fedavg", None, keys)
        free = run_in_process(skewed, "fedavg", None, keys, defences=False)
        honest.append(
            {
                "scenario": scenario,
                "seed": seed,
                "train_sizes": [len(site.train) for site in skewed.sites],
                "auc_defaults": round(on.auc, 4),
                "auc_without": round(free.auc, 4),
                "difference": round(on.auc - free.auc, 4),
                "site_rounds_left_out": on.left_out,
                "site_rounds_bounded": on.bounded,
            }
        )
        h = honest[-1]
        print(
            f"honest {scenario} seed {seed} sizes {h['train_sizes']}: AUC {h['auc_defaults']:.4f} with the "
            f"defaults, {h['auc_without']:.4f} without ({h['difference']:+.4f}); site-rounds left out "
            f"{h['site_rounds_left_out']}, bounded {h['site_rounds_bounded']}",
            flush=True,
        )
    failed = sum(r["crashed_or_stalled"] for r in rows)
    drops = [r["auc_drop"] for r in rows if not np.isnan(r["auc_drop"])]
    worst = max(drops) if drops else float("nan")
    summary = {"tried": len(rows), "crashed_or_stalled": failed, "worst_auc_drop": round(worst, 4)}
    if ns.out:
        out = Path(ns.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "command": "PYTHONPATH=custom .venv/bin/python benchmarks/bench_attacks.py --out " + str(ns.out),
            "settings": {
                "client": {
                    k: v
                    for k, v in vars(ARGS).items()
                    if k in ("dataset", "scenario", "num_images", "size", "max_steps", "batch_size")
                },
                "sites": list(SITES),
                "attacker": ATTACKER,
                "rounds": ROUNDS,
                "server_secure_sum_floor": SERVER_FLOOR,
                "site_policy_min_secure_sum": SITE_MIN,
                "train_timeout_s": TRAIN_TIMEOUT,
                "python": sys.version.split()[0],
                "torch_threads": torch.get_num_threads(),
            },
            "clean_auc": {k: round(v.auc, 4) for k, v in clean.items()},
            "attacks": rows,
            "honest_cost": honest,
            "summary": summary,
        }
        out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"attacks: {len(rows)} tried, {failed} crashed or stalled, worst AUC drop {worst:.4f}")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
