"""Attacks on the encrypted paths: one site against HE model updates and the secure statistics phase.

    cd <checkout> && PYTHONPATH=custom .venv/bin/python benchmarks/attacks_he.py [--out FILE.json]
        [--no-defences]

The server cannot read a ciphertext, so under HE it cannot bound or leave out a bad contribution;
what stands against these attacks is the sites' side: the checks on every decrypted global model
(:class:`fedweigh.site.he_guard.HEModelGuard`: finite values, BatchNorm variances, the check slot,
the global update against the site's references; each site clips its own update) and the checks on
the decoded statistics sum (:func:`fedweigh.histograms.decode_sum`,
:func:`fedweigh.histograms.check_announced_size`, the count slot in
:func:`fedweigh.secure.vectors.decrypt_vector`), with FedDisco's fallback to the uniform target
when a site holds no global histogram.

Setting (as benchmarks/bench_attacks.py): SynthCXR, iid-4 (4 sites of 270 training images), 32 px, the
compact DenseNet, 5 rounds of 10 local Adam steps; site-4 runs the sites' code and alters what it sends,
in every round (two variants: in round 2 only, to show that the sites' updates repair the model once the
attack stops). Everything runs in this
process with the code the NVFlare client and controller run: ``SiteTrainer``, ``HEModelGuard``,
``decrypt_global`` / ``encode_update``, the server's ``RoundStep`` with ``EncryptedGlobalModel``; the
statistics phase through ``answer_statistics_task`` at every site and ``sum_statistics`` +
``announced_size`` at the server.

- HE model updates (FedAvg under HE): site-4 adds 0.1 or 1.0 to every encrypted value of its update, or
  puts 5 instead of 1 in its check slot.
- secure statistics (FedDisco, ``target="global"``, plaintext rounds): site-4's encrypted statistics
  vector holds a negative count, a count slot of 2, or N_k = 1,000,000 inside the ciphertext while
  it reports its true N_k in clear.

Per attack: whether the job crashed (an exception escaped) or stalled (a round left the server's model
unchanged, or a site could not answer a task), the rounds in which the honest sites refused the model
they decrypted, and the AUC drop: clean AUC - AUC of the model the honest sites hold after the last
round (under HE the model they accepted last), on the test set. :func:`run_he_attacks` returns the rows
(benchmarks/bench_attacks.py counts them into ``H (HE)``).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from nvflare.app_common.abstract.fl_model import FLModel

from fedweigh.data import build_federation
from fedweigh.flare.statistics import META_MODE, META_STEP, announced_size, answer_statistics_task
from fedweigh.histograms import META_LENGTH
from fedweigh.protocol import META_MIN_SECURE_SUM, META_NUM_SAMPLES, META_NUM_STEPS, META_SCALARS
from fedweigh.server.label_stats import sum_statistics
from fedweigh.server.quorum import server_floor
from fedweigh.server.rounds import ClientResult, PlaintextBackend, RoundStep
from fedweigh.server.safeguards import Safeguards
from fedweigh.site.args import ClientArgs
from fedweigh.site.he_guard import HEModelGuard, HEReceipt
from fedweigh.site.policy import PROVISIONED_DEFAULT, SitePolicy
from fedweigh.site.trainer import SiteTrainer, build_site_model
from fedweigh.train import evaluate, get_params, set_params
from fedweigh.weighting import get_scheme

__all__ = [
    "HE_ATTACKS",
    "HEAttack",
    "Keys",
    "markdown_table",
    "run_he_attack",
    "run_he_attacks",
    "tamper_statistics",
    "tamper_update",
]

ATTACKER = "site-4"
SITES = ("site-1", "site-2", "site-3", "site-4")
ROUNDS = 5
ARGS = ClientArgs(
    dataset="synthcxr", scenario="iid-4", num_images=1200, size=32, max_steps=10, batch_size=16, threads=1
)
#: The sites' policy: a provisioned hospital's default (decrypts no secure sum of fewer than 3).
SITE_POLICY: SitePolicy = PROVISIONED_DEFAULT
SERVER_FLOOR = server_floor(3, len(SITES))
#: The statistics attacks' scheme: FedDisco against the securely summed global histogram.
STATS_SCHEME, STATS_SCHEME_ARGS = "feddisco", {"target": "global"}


@dataclass(frozen=True)
class HEAttack:
    """One attack: its name, its kind (what :func:`tamper_update` / :func:`tamper_statistics` do) and
    the path it targets (``"HE updates"`` or ``"secure statistics"``)."""

    name: str
    kind: str
    path: str


HE_ATTACKS = [
    HEAttack("HE: one site adds 0.1 to every value of its update", "he-add-0.1", "HE updates"),
    HEAttack("HE: one site adds 1.0 to every value of its update", "he-add-1.0", "HE updates"),
    HEAttack("HE: forged check slot (5 instead of 1)", "he-check-slot", "HE updates"),
    HEAttack("HE: one site adds 0.1 to every value, round 2 only", "he-add-0.1@2", "HE updates"),
    HEAttack("HE: forged check slot, round 2 only", "he-check-slot@2", "HE updates"),
    HEAttack("statistics: forged ciphertext with a negative count", "stats-negative", "secure statistics"),
    HEAttack("statistics: forged count slot (2 instead of 1)", "stats-count-slot", "secure statistics"),
    HEAttack(
        "statistics: inflated counts (N_k = 1,000,000 inside, true N_k in clear)",
        "stats-inflate",
        "secure statistics",
    ),
]


class Keys:
    """One CKKS key pair (HEBuilder's parameters) made in this process."""

    def __init__(self):
        from fedweigh.secure.contexts import context_from_bytes, make_context, serialize_context

        self.secret = make_context()
        self.public = context_from_bytes(serialize_context(self.secret, with_secret_key=False), role="server")

    def provider(self, role: str):
        return self.secret if role == "client" else self.public


# ------------------------------------------------------------------------------------------- attacks
def _attacks_in(kind: str, t: int) -> bool:
    """Whether attack ``kind`` (``name`` or ``name@round``) is made in round ``t``."""
    return "@" not in kind or int(kind.split("@")[1]) == t


def tamper_update(kind: str, outgoing: dict, keys_encrypted) -> tuple[dict, float]:
    """The attacker's parameters before encryption and its check slot: +0.1 / +1.0 on every encrypted
    value, or a check slot of 5 (``kind`` may end in ``@round``: only in that round)."""
    kind = kind.split("@")[0]
    if kind.startswith("he-add-"):
        shift = float(kind.rsplit("-", 1)[1])
        out = dict(outgoing)
        for k in keys_encrypted:
            out[k] = (np.asarray(outgoing[k], np.float64) + shift).astype(np.asarray(outgoing[k]).dtype)
        return out, 1.0
    if kind == "he-check-slot":
        return dict(outgoing), 5.0
    raise ValueError(f"not an HE update attack: {kind!r}")


def _reencrypt(ctx, data: bytes, change: Callable[[list[float]], list[float]]) -> bytes:
    import tenseal as ts

    return ts.ckks_vector(ctx, change(ts.ckks_vector_from(ctx, data).decrypt())).serialize()


def tamper_statistics(kind: str, payload: dict, secret_ctx, length: int) -> dict:
    """The attacker's statistics contribution (its collect answer's meta), forged inside the ciphertext:
    the slot layout is [lo_1..lo_L, hi_1..hi_L, count] (:mod:`fedweigh.secure.vectors`), entry j = hi_j
    2^20 + lo_j; the entries are [n_1..n_C, N_k, N_k c_k]."""
    from fedweigh.secure.exchange import META_CIPHERTEXT

    data = base64.b64decode(payload[META_CIPHERTEXT])

    def change(slots: list[float]) -> list[float]:
        slots = list(slots)
        if kind == "stats-negative":
            slots[0] = -5000.0  # n_1 -5000 (lo limb): the sum's first count goes negative
        elif kind == "stats-count-slot":
            slots[-1] = 2.0
        elif kind == "stats-inflate":
            n_index = length - 2
            slots[n_index] = (
                slots[n_index] + 1_000_000.0 - round(slots[n_index] + 2**20 * slots[length + n_index])
            )
        else:
            raise ValueError(f"not a statistics attack: {kind!r}")
        return slots

    return {**payload, META_CIPHERTEXT: base64.b64encode(_reencrypt(secret_ctx, data, change)).decode()}


# ------------------------------------------------------------------------------------------- runs
@dataclass
class HERun:
    completed: bool
    stalled_rounds: list[int]
    refused_rounds: list[int]
    notes: list[str]
    auc: float
    seconds: float
    error: str = ""
    extra: dict = field(default_factory=dict)


def _he_rounds(fed, kind: str | None, keys: Keys, defences: bool) -> HERun:
    """FedAvg under HE, every site with its guard (``defences=False``: the sites use whatever decrypts
    and refuse only what does not)."""
    from fedweigh.secure.updates import decrypt_global, encode_update
    from fedweigh.server.encrypted import EncryptedGlobalModel

    start = time.perf_counter()
    trainers = {s.name: SiteTrainer(s, fed.test, ARGS, threads=1) for s in fed.sites}
    scorer = build_site_model(ARGS, fed.test)
    g0 = get_params(scorer)
    backend = EncryptedGlobalModel(keys.public, g0)
    step = RoundStep(
        get_scheme("fedavg"),
        backend,
        num_rounds=ROUNDS,
        safeguards=Safeguards(min_clients=2, min_secure_sum=SERVER_FLOOR),
        log=lambda m: None,
    )
    guards = {s: HEModelGuard(s, clip_factor=None if not defences else 3.0) for s in trainers}
    held: dict[str, dict] = {}
    stalled, refused, notes = [], [], []
    for t in range(1, ROUNDS + 2):  # round ROUNDS + 1: the final model's delivery (validate)
        received = backend.task_params()
        plan = step.plan("fedavg", {})
        results, refusing = [], 0
        for site, trainer in trainers.items():
            try:
                decrypted = decrypt_global(
                    keys.secret, received, backend.meta(), g0, SITE_POLICY.min_secure_sum
                )
                # the attacker runs the sites' code and alters only what it sends, in its attack rounds
                attacking = site == ATTACKER and kind is not None and _attacks_in(kind, t)
                if defences:
                    receipt = guards[site].receive(decrypted, t, backend.meta().get("steps"))
                    if receipt.refusal and site != ATTACKER:
                        refusing += 1
                        notes.append(receipt.refusal.replace(f"{site} refuses", "a site refuses"))
                else:  # no checks: the model that decrypts is used (a wrong check slot still raises)
                    problem = decrypted.check_problem
                    if problem:
                        raise ValueError(problem)
                    receipt = HEReceipt(decrypted.params, decrypted.params)
            except ValueError as e:  # an honest site that cannot answer: the job stalls
                notes.append(f"{site}: {e}")
                if t <= ROUNDS:
                    stalled.append(t)
                continue
            held[site] = receipt.use
            if t > ROUNDS:
                continue
            out = trainer.run_round(receipt.use, t - 1, plan, total_rounds=ROUNDS, evaluate_received=False)
            keys_enc = decrypted.layout.keys
            if attacking:
                honest = (
                    guards[site].outgoing(out.params, receipt, keys_enc, out.num_steps)
                    if defences
                    else out.params
                )
                outgoing, check = tamper_update(kind, honest, keys_enc)
                check = check if check != 1.0 else receipt.check
                params = encode_update(keys.secret, outgoing, receipt.received, decrypted.layout, check=check)
            elif defences:
                params = guards[site].encode(
                    keys.secret, out.params, receipt, decrypted.layout, out.num_steps
                )
            else:
                params = encode_update(keys.secret, out.params, receipt.received, decrypted.layout)
            meta = {
                META_NUM_SAMPLES: out.num_samples,
                META_NUM_STEPS: out.num_steps,
                META_SCALARS: out.scalars,
                META_MIN_SECURE_SUM: SITE_POLICY.min_secure_sum,
            }
            results.append(ClientResult(site, params, meta, out.metrics))
        if refusing:
            refused.append(t)
        if t > ROUNDS:
            break
        outcome = step.run(t, results, list(SITES))
        if not outcome.updated:
            stalled.append(t)
            notes.append(f"round {t}: the server's model unchanged ({outcome.reason})")
    honest = [s for s in SITES if s != ATTACKER and s in held]
    auc = float("nan")
    if honest:
        set_params(scorer, held[honest[0]])
        auc = float(evaluate(scorer, fed.test)["auc"])
    return HERun(True, sorted(set(stalled)), refused, notes, auc, time.perf_counter() - start)


def _statistics_then_rounds(fed, kind: str | None, keys: Keys, defences: bool) -> HERun:
    """The secure statistics phase as the controller and the sites run it, then FedDisco (global target)
    in plaintext rounds with the round step's defaults."""
    from fedweigh.secure.exchange import SecureExchange

    start = time.perf_counter()
    trainers = {s.name: SiteTrainer(s, fed.test, ARGS, threads=1) for s in fed.sites}
    for trainer in trainers.values():
        trainer.job_id = f"attacks-he-{kind or 'clean'}"
    notes: list[str] = []
    collect = FLModel(params={}, meta={META_STEP: "collect", META_MODE: "secure"})
    payloads: dict[str, object] = {}
    with _statistics_keys(keys):
        for site, trainer in trainers.items():
            answer = answer_statistics_task(trainer, collect, SITE_POLICY)
            meta = dict(answer.meta or {})
            if site == ATTACKER and kind is not None:
                meta = tamper_statistics(kind, meta, keys.secret, int(meta[META_LENGTH]))
            payloads[site] = meta
        outcome = sum_statistics(SecureExchange(keys.provider), payloads, SERVER_FLOOR)
        announced = announced_size(payloads, outcome.members)
        decoded = 0
        if outcome.total is not None:
            distribute = FLModel(
                params={}, meta={META_STEP: "distribute", META_MODE: "secure", **outcome.total, **announced}
            )
            for trainer in trainers.values():
                answer = answer_statistics_task(trainer, distribute, SITE_POLICY)
                if (answer.meta or {}).get("ok"):
                    decoded += 1
                elif (answer.meta or {}).get("error") and f"{(answer.meta or {})['error']}" not in notes:
                    notes.append(f"sites refuse the sum: {answer.meta['error']}")
        else:
            notes.append(f"server: nothing summed: {outcome.reason}")
    n_values = {s: t.global_stats.num_samples for s, t in trainers.items() if t.global_stats is not None}
    scorer = build_site_model(ARGS, fed.test)
    g = get_params(scorer)
    backend = PlaintextBackend(g)
    step = RoundStep(
        get_scheme(STATS_SCHEME, **STATS_SCHEME_ARGS),
        backend,
        num_rounds=ROUNDS,
        safeguards=Safeguards(min_clients=2, min_secure_sum=SERVER_FLOOR),
        log=lambda m: None,
    )
    stalled = []
    for t in range(1, ROUNDS + 1):
        plan = step.plan(STATS_SCHEME, STATS_SCHEME_ARGS)
        results = []
        for site, trainer in trainers.items():
            try:
                out = trainer.run_round(
                    backend.task_params(), t - 1, plan, total_rounds=ROUNDS, evaluate_received=False
                )
            except ValueError as e:  # e.g. a scheme that cannot compute its scalars
                notes.append(f"{site} round {t}: {e}")
                continue
            meta = {
                META_NUM_SAMPLES: out.num_samples,
                META_NUM_STEPS: out.num_steps,
                META_SCALARS: out.scalars,
            }
            results.append(ClientResult(site, out.params, meta, out.metrics))
        outcome = step.run(t, results, list(SITES))
        if not outcome.updated:
            stalled.append(t)
            notes.append(f"round {t}: the server's model unchanged ({outcome.reason})")
    set_params(scorer, backend.task_params())
    auc = float(evaluate(scorer, fed.test)["auc"])
    run = HERun(True, stalled, [], notes, auc, time.perf_counter() - start)
    run.extra = {"sites_decoded": decoded, "decoded_N": n_values}
    return run


@contextlib.contextmanager
def _statistics_keys(keys: Keys):
    """The statistics exchange finds its keys through fedweigh.flare.keys; point it at this process's pair
    (a folder holding the two context files, ``FEDWEIGH_HE_CONTEXT_DIR``)."""
    from fedweigh.secure.contexts import CONTEXT_DIR_ENV, save_context_files

    with tempfile.TemporaryDirectory() as folder:
        save_context_files(Path(folder), keys.secret)
        old = os.environ.get(CONTEXT_DIR_ENV)
        os.environ[CONTEXT_DIR_ENV] = folder
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(CONTEXT_DIR_ENV, None)
            else:
                os.environ[CONTEXT_DIR_ENV] = old


def run_he_attack(fed, kind: str | None, path: str, keys: Keys, defences: bool = True) -> HERun:
    """One run of ``path`` (``"HE updates"`` or ``"secure statistics"``) with attack ``kind`` (None: clean);
    an exception that escapes is a crashed job."""
    try:
        if path == "HE updates":
            return _he_rounds(fed, kind, keys, defences)
        return _statistics_then_rounds(fed, kind, keys, defences)
    except Exception as e:  # an attack that escapes every check crashes the job
        return HERun(False, [], [], [f"{type(e).__name__}: {e}"], float("nan"), 0.0, error=str(e)[:500])


def _why(notes: list[str]) -> str:
    """The distinct reasons, those that differ only in their figures (rounds, ratios) counted once."""
    import re

    groups: dict[str, list[str]] = {}
    for note in notes:
        groups.setdefault(re.sub(r"[-+]?\d[\d.,e+]*", "#", note), []).append(note)
    return "; ".join(t[0] + (f" (x{len(t)})" if len(t) > 1 else "") for t in groups.values()) or "-"


def run_he_attacks(
    fed=None,
    attacks: list[HEAttack] | None = None,
    keys: Keys | None = None,
    defences: bool = True,
    log=print,
) -> list[dict]:
    """Every attack of ``attacks`` (default :data:`HE_ATTACKS`) against its clean run; one row each:
    attack, path, completed, stalled_rounds, refused_rounds, crashed_or_stalled, why, auc, clean_auc,
    auc_drop, seconds."""
    fed = fed or build_federation(
        ARGS.scenario, ARGS.dataset, size=ARGS.size, seed=ARGS.seed, num_images=ARGS.num_images
    )
    keys = keys or Keys()
    attacks = HE_ATTACKS if attacks is None else attacks
    clean: dict[str, HERun] = {}
    rows = []
    with tempfile.TemporaryDirectory() as work, contextlib.chdir(work):  # the sites' statistics files
        for attack in attacks:
            if attack.path not in clean:
                clean[attack.path] = run_he_attack(fed, None, attack.path, keys, defences)
                log(
                    f"clean {attack.path}: AUC {clean[attack.path].auc:.4f} ({clean[attack.path].seconds:.0f} s)"
                )
            run = run_he_attack(fed, attack.kind, attack.path, keys, defences)
            failed = not run.completed or bool(run.stalled_rounds)
            drop = clean[attack.path].auc - run.auc if run.completed else float("nan")
            rows.append(
                {
                    "attack": attack.name,
                    "kind": attack.kind,
                    "path": attack.path,
                    "completed": run.completed,
                    "stalled_rounds": run.stalled_rounds,
                    "refused_rounds": run.refused_rounds,
                    "crashed_or_stalled": failed,
                    "why": _why(run.notes),
                    "auc": round(run.auc, 4),
                    "clean_auc": round(clean[attack.path].auc, 4),
                    "auc_drop": round(drop, 4),
                    "seconds": round(run.seconds, 1),
                    **run.extra,
                    **({"error": run.error} if run.error else {}),
                }
            )
            r = rows[-1]
            log(
                f"{attack.name:<70} crashed/stalled={failed!s:<5} refused rounds {r['refused_rounds']} "
                f"AUC {r['auc']:.4f} (clean {r['clean_auc']:.4f}, drop {r['auc_drop']:+.4f})"
            )
    return rows


def markdown_table(record: dict) -> str:
    """The results of a run (its JSON) as the table of docs/security.md."""
    lines = [
        "| attack | path | crashed or stalled | rounds the honest sites refused the model | AUC | clean AUC "
        "| AUC drop |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in record["attacks"]:
        refused = ", ".join(map(str, r["refused_rounds"])) or "-"
        lines.append(
            f"| {r['attack']} | {r['path']} | {'YES' if r['crashed_or_stalled'] else 'no'} | {refused} "
            f"| {r['auc']:.4f} | {r['clean_auc']:.4f} | {r['auc_drop']:+.4f} |"
        )
    s = record["summary"]
    lines += [
        "",
        f"HE attacks: {s['tried']} tried, {s['crashed_or_stalled']} crashed or stalled, worst AUC drop "
        f"{s['worst_auc_drop']:.4f}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--no-defences", action="store_true", help="the sites use whatever decrypts")
    parser.add_argument(
        "--markdown", default=None, help="print the table of a results JSON and exit (no run)"
    )
    ns = parser.parse_args(argv)
    if ns.markdown:
        print(markdown_table(json.loads(Path(ns.markdown).read_text())))
        return 0
    torch.set_num_threads(1)
    os.environ.setdefault("FEDWEIGH_CACHE", str(Path(tempfile.gettempdir()) / "fedweigh-bench-cache"))
    rows = run_he_attacks(defences=not ns.no_defences)
    failed = sum(r["crashed_or_stalled"] for r in rows)
    drops = [r["auc_drop"] for r in rows if not np.isnan(r["auc_drop"])]
    worst = max(drops) if drops else float("nan")
    if ns.out:
        record = {
            "command": "PYTHONPATH=custom .venv/bin/python benchmarks/attacks_he.py --out "
            + str(ns.out)
            + (" --no-defences" if ns.no_defences else ""),
            "settings": {
                "client": {
                    k: v
                    for k, v in vars(ARGS).items()
                    if k in ("dataset", "scenario", "num_images", "size", "max_steps", "batch_size")
                },
                "sites": list(SITES),
                "attacker": ATTACKER,
                "rounds": ROUNDS,
                "defences": not ns.no_defences,
                "python": sys.version.split()[0],
            },
            "attacks": rows,
            "summary": {"tried": len(rows), "crashed_or_stalled": failed, "worst_auc_drop": round(worst, 4)},
        }
        from fedweigh.io import atomic_write_json

        atomic_write_json(ns.out, record, indent=1)
    print(f"HE attacks: {len(rows)} tried, {failed} crashed or stalled, worst AUC drop {worst:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
