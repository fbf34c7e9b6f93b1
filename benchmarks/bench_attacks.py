"""One run per attack against a 4-site federation: did the job complete, were the attacking sites
left out (or their updates bounded) and why, and the final test AUC against the same job without
the attack.

    cd <checkout> && PYTHONPATH=custom .venv/bin/python benchmarks/bench_attacks.py \\
        --safeguards deploy --out docs/results/security/attacks-deploy.json

Setting: SynthCXR, scenario iid-4 (4 sites, 270 training images each, 240 test images), 32 px,
the compact DenseNet, 5 rounds of 10 local Adam steps (batch 16); site-4 attacks in every round
(two colluders: site-3 and site-4; from round 2 for the replay, in round 2 for the silent and
crashing site). ``--safeguards`` picks the server's settings (:data:`fedweigh.bench.config.SAFEGUARDS`):
``deploy``, the defaults a job gets (the round step's checks, the weight cap, the update norm bound,
the direction check); ``off``, none of them; ``robust``, the defaults with the weighted median and
the per-array direction check (:mod:`fedweigh.server.robust`; runs with encrypted updates keep the
defaults, the robust options need plaintext). Every mode keeps the server's secure-sum quorum (3 of
4) and the sites' default provisioned policy (they decrypt no sum of fewer than 3 contributions).

Scheme families (the column ``family``): size-driven (FedAvg; weights from N_k), step-driven
(FedNova; tau_k), scalar-driven (FedBB's CBR, DAFL, FedDisco; a scalar the site reports) and
parameter-driven (FedDRAW; the server's similarity of the site's model).

Attacks "at the norm bound" scale the altered arrays to :data:`BOUND_FACTOR` times the attacker's
own honest update of the same array: just inside the default bound (3 x the median of the others'),
which an attacker with iid data can estimate from its own update.

Paths (the column ``path``):

- ``round step``: in this process, the server's :class:`fedweigh.server.rounds.RoundStep` (the code the
  NVFlare controller runs) with four :class:`fedweigh.site.trainer.SiteTrainer` and the run's
  :class:`fedweigh.server.records.RoundRecorder` (written every round, as the controller does); the
  attacker's result is altered after honest training (label-flip attackers train on flipped labels).
  ``round step (HE)``: the same with the CKKS backend
  (:class:`fedweigh.server.encrypted.EncryptedGlobalModel`) and TenSEAL keys made here.
- ``statistics phase``: in this process, the secure label-statistics exchange the controller runs
  (:func:`fedweigh.server.label_stats.sum_statistics` with :class:`fedweigh.secure.exchange.SecureExchange`
  at the server, each site's quorum check before decrypting), then the rounds as above.
- ``simulator``: ``nvflare simulator`` with the job's real transport, the fedweigh controller and
  client script; benchmarks/attack_client.py replaces site-4's entry script. Used where the attack
  is on the transport itself: a silent site (the server waits ``train_timeout``) and a crashing one.

More attacks on encrypted updates live in ``benchmarks/attacks_he.py``: its
``run_he_attacks(fed, defences=...)`` gets the federation and whether the sites' checks are on,
and returns its rows, which get the columns of :func:`attack_row` they lack (``he`` true) and are
counted in the summary.

AUC drop = clean AUC - attacked AUC of the global model after the last round, on the test set, against
the clean run of the same method, path and safeguards. "Crashed or stalled": the job did not finish
(an exception escaped the server), a training round left the global model unchanged, or the final
global model gives non-finite outputs. The last line reads
``attacks: N tried, C crashed or stalled, worst AUC drop D (one site), E (two colluders), H (HE)``
(worst drops over the attacks that completed; ``n/a`` where no attack of that kind ran).
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

from fedweigh.bench.config import SAFEGUARDS
from fedweigh.data import build_federation
from fedweigh.histograms import META_LENGTH, META_NUM_CONTRIBUTIONS, decode_sum, statistics_vector
from fedweigh.io import atomic_write_text
from fedweigh.protocol import META_MIN_SECURE_SUM, META_NUM_SAMPLES, META_NUM_STEPS, META_SCALARS
from fedweigh.server.label_stats import sum_statistics
from fedweigh.server.quorum import server_floor
from fedweigh.server.records import RoundRecorder
from fedweigh.server.rounds import ClientResult, PlaintextBackend, RoundStep
from fedweigh.server.safeguards import Safeguards
from fedweigh.site.args import ClientArgs
from fedweigh.site.policy import PROVISIONED_DEFAULT
from fedweigh.site.trainer import SiteTrainer, build_site_model
from fedweigh.train import evaluate, get_params, set_params
from fedweigh.weighting import get_scheme

ATTACKER = "site-4"
#: Two colluding sites.
PAIR = ("site-3", "site-4")
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
#: Attacks at the norm bound: the altered arrays at this many times the attacker's own honest update
#: of the array (the default bound is 3 x the median of the other sites').
BOUND_FACTOR = 2.9
#: Forged sample counts: this many times the true one.
FORGED_COUNT = 1000


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
    "fednova": Method("fednova"),
    "cbr": Method("cbr"),
    "fedbb": Method("cbr", loss="pnb"),
    "dafl": Method("dafl", loss="dafl", statistics=True),
    "dafl-inverse": Method("dafl", {"mode": "inverse_imbalance"}, loss="dafl", statistics=True),
    "feddisco": Method("feddisco"),
    "fedavg-he": Method("fedavg", he=True),
}
#: The scheme family of each method: what drives its weights.
FAMILY = {
    "fedavg": "size",
    "fedavg-he": "size",
    "fednova": "step",
    "feddraw": "parameter",
    "cbr": "scalar",
    "fedbb": "scalar",
    "dafl": "scalar",
    "dafl-inverse": "scalar",
    "feddisco": "scalar",
}


@dataclass(frozen=True)
class Attack:
    name: str
    kind: str
    method: str
    path: str
    attackers: tuple[str, ...] = (ATTACKER,)


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
#: Where the attacks with in-range values start (``--in-range``).
FIRST_ISSUE_25 = len(ATTACKS)
ATTACKS += [
    # BatchNorm statistics, noise and layer-targeted updates at the norm bound
    Attack("BatchNorm running_var driven negative at the norm bound", "bn-negvar", "fedavg", "round step"),
    Attack("BatchNorm running_var driven negative at the norm bound", "bn-negvar", "fedbb", "round step"),
    Attack("BatchNorm running_var driven negative at the norm bound", "bn-negvar", "fednova", "round step"),
    Attack("random noise at the norm bound", "noise", "fedavg", "round step"),
    Attack("random noise at the norm bound", "noise", "feddraw", "round step"),
    Attack("random noise at the norm bound", "noise", "fednova", "round step"),
    Attack("random noise at the norm bound", "noise", "dafl", "statistics phase"),
    Attack("classifier layers flipped at the norm bound", "flip-head", "fedavg", "round step"),
    Attack("classifier layers flipped at the norm bound", "flip-head", "feddraw", "round step"),
    Attack("classifier flipped + forged sample count (x1000)", "flip-head+samples", "fedavg", "round step"),
    Attack("classifier flipped + forged skew 0", "flip-head+skew", "fedbb", "round step"),
    # forged quantities that drive weights
    Attack("forged FedNova step count 1", "steps:1", "fednova", "round step"),
    Attack("forged FedNova step count 1,000", "steps:1000", "fednova", "round step"),
    Attack("forged FedNova step count 10^7", "steps:10000000", "fednova", "round step"),
    Attack("forged discrepancy 0 (FedDisco)", "discrepancy", "feddisco", "round step"),
    Attack("label-flip poisoning + forged sample count (x1000)", "labelflip+samples", "fedavg", "round step"),
    Attack("label-flip poisoning + forged discrepancy 0", "labelflip+discrepancy", "feddisco", "round step"),
    # the run's records
    Attack("site metric named 'weights'", "metric:weights", "fedavg", "round step"),
    Attack("site metric named 'excluded'", "metric:excluded", "fedavg", "round step"),
    Attack("site metrics named 'round' and 'global_updated'", "metric:round", "fedavg", "round step"),
    # two colluding sites
    Attack("forged counts (x1000) + noise at the norm bound", "noise+samples", "fedavg", "round step", PAIR),
    Attack("classifier layers flipped at the norm bound", "flip-head", "fedavg", "round step", PAIR),
    Attack("classifier flipped + forged sample counts", "flip-head+samples", "feddraw", "round step", PAIR),
    Attack(
        "BatchNorm running_var driven negative at the norm bound", "bn-negvar", "fedavg", "round step", PAIR
    ),
    Attack("forged FedNova step counts 1,000", "steps:1000", "fednova", "round step", PAIR),
    Attack("label-flip poisoning + forged sample counts", "labelflip+samples", "fedavg", "round step", PAIR),
    Attack("classifier flipped + forged skew 0", "flip-head+skew", "fedbb", "round step", PAIR),
    Attack("scaled sign-flipped updates (-10 x Delta)", "signflip", "fedavg", "round step", PAIR),
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
    #: the settings the run used, when they differ from the mode's (robust options under HE)
    safeguards_note: str = ""


# --------------------------------------------------------------------------------------- keys
def _load_attacks_he():
    """benchmarks/attacks_he.py, loaded by path (the benchmarks are scripts, not a package)."""
    import importlib.util

    if "attacks_he" in sys.modules:
        return sys.modules["attacks_he"]
    spec = importlib.util.spec_from_file_location("attacks_he", Path(__file__).with_name("attacks_he.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["attacks_he"] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


attacks_he = _load_attacks_he()
Keys = attacks_he.Keys  # one CKKS key pair (HEBuilder's parameters), defined once in attacks_he.py


def _reencrypt_at_scale(ctx, data: bytes, scale: float) -> bytes:
    import tenseal as ts

    values = ts.ckks_vector_from(ctx, data).decrypt()
    return ts.ckks_vector(ctx, values, scale=scale).serialize()


# --------------------------------------------------------------------------------------- in process
def _at_bound(g: np.ndarray, honest: np.ndarray, direction: np.ndarray) -> np.ndarray:
    """g + ``direction`` scaled to BOUND_FACTOR x the norm of the honest update honest - g."""
    g64 = np.asarray(g, np.float64)
    norm = float(np.linalg.norm(np.asarray(honest, np.float64) - g64))
    d = np.asarray(direction, np.float64)
    size = float(np.linalg.norm(d))
    return g64 + (BOUND_FACTOR * norm / size) * d if size > 0 else g64


def _tamper(
    kind: str, result: ClientResult, g: dict, t: int, memory: dict, keys: Keys | None
) -> ClientResult:
    """An attacker's honest result, altered by the attack (``a+b``: both)."""
    params = dict(result.params)
    meta = dict(result.meta)
    metrics = dict(result.metrics or {})
    floats = [k for k, v in params.items() if np.asarray(v).dtype.kind == "f"]
    rng = np.random.default_rng([t, sum(map(ord, result.site))])
    for part in kind.split("+"):
        if part == "nan":
            params[floats[0]] = np.full_like(params[floats[0]], np.nan)
        elif part == "inf":
            params[floats[0]] = np.full_like(params[floats[0]], np.inf)
        elif part == "huge":
            for k in floats:
                params[k] = (np.asarray(g[k], np.float64) + 1e30).astype(params[k].dtype)
        elif part == "signflip":
            for k in floats:
                g64 = np.asarray(g[k], np.float64)
                params[k] = (g64 - 10.0 * (np.asarray(params[k], np.float64) - g64)).astype(params[k].dtype)
        elif part == "dtype":
            params[floats[0]] = params[floats[0]].astype(np.complex64)
        elif part == "shape":
            key = next(k for k in floats if params[k].ndim >= 2)
            params[key] = params[key][:-1]
        elif part == "samples":
            meta[META_NUM_SAMPLES] = FORGED_COUNT * int(meta[META_NUM_SAMPLES])
        elif part.startswith("steps:"):
            meta[META_NUM_STEPS] = int(part.split(":")[1])
        elif part in ("similarity", "imbalance", "skew", "discrepancy"):
            meta[META_SCALARS] = {**meta.get(META_SCALARS, {}), part: 1.0 if part == "similarity" else 0.0}
        elif part == "bn-negvar":  # the smallest variance of every BatchNorm pushed down, at the bound
            for k in (k for k in floats if k.endswith("running_var")):
                g64 = np.asarray(g[k], np.float64)
                push = np.zeros(g64.shape)
                push.flat[int(np.argmin(g64))] = -1.0
                params[k] = _at_bound(g64, params[k], push).astype(params[k].dtype)
        elif part == "noise":  # every array a random direction, at the bound
            for k in floats:
                params[k] = _at_bound(g[k], params[k], rng.normal(size=np.shape(g[k]))).astype(
                    params[k].dtype
                )
        elif part == "flip-head":  # only the classifier's arrays, flipped, at the bound
            for k in (k for k in floats if "class_layers" in k):
                g64 = np.asarray(g[k], np.float64)
                params[k] = _at_bound(g64, params[k], g64 - np.asarray(params[k], np.float64)).astype(
                    params[k].dtype
                )
        elif part == "labelflip":  # trained on flipped labels (run_in_process); the update is sent as is
            pass
        elif part.startswith("metric:"):
            name = part.split(":")[1]
            metrics.update({"round": 99.0, "global_updated": 0.0} if name == "round" else {name: 1.0})
        elif part == "replay":
            if t == 1:
                memory["replay"] = {k: np.copy(v) for k, v in params.items()}
            else:
                params = memory["replay"]
        elif part == "he-scale":
            from fedweigh.secure.updates import UPDATE_PREFIX, pack_chunks, unpack_chunks

            chunks, clear = unpack_chunks(params, UPDATE_PREFIX)
            chunks[0] = _reencrypt_at_scale(keys.secret, chunks[0], 2.0**30)
            params = {**pack_chunks(chunks, UPDATE_PREFIX), **clear}
        else:
            raise ValueError(f"unknown attack kind {part!r}")
    return replace(result, params=params, meta=meta, metrics=metrics)


def _flipped(site):
    """The site with every training label flipped (multi-label: 1 - y)."""
    train = site.train
    return replace(site, train=replace(train, labels=(1.0 - train.labels).astype(train.labels.dtype)))


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


def mode_safeguards(mode: str, encrypted: bool = False) -> tuple[Safeguards, str]:
    """The round step's safeguards of ``mode`` with the bench's quorum, and a note when they differ
    from the mode's (the robust options need plaintext: runs with encrypted updates keep the defaults)."""
    quorum = {"min_clients": 2, "min_secure_sum": SERVER_FLOOR}
    preset = SAFEGUARDS[mode]
    note = ""
    if encrypted and preset.robust:
        preset, note = SAFEGUARDS["deploy"], "encrypted updates: the defaults (robust options need plaintext)"
    return replace(preset, **quorum, source=f"bench_attacks --safeguards {mode}"), note


def run_in_process(
    fed,
    method_name: str,
    kind: str | None,
    keys: Keys,
    mode: str = "deploy",
    attackers: tuple[str, ...] = (ATTACKER,),
) -> RunResult:
    """One in-process run (module docstring); an exception escaping the server is the caller's crash."""
    from fedweigh.secure.updates import decode_global, encode_update
    from fedweigh.server.encrypted import EncryptedGlobalModel

    start = time.perf_counter()
    method = METHODS[method_name]
    args = replace(ARGS, loss=method.loss)
    poisoned = kind is not None and "labelflip" in kind
    trainers = {
        s.name: SiteTrainer(_flipped(s) if poisoned and s.name in attackers else s, fed.test, args, threads=1)
        for s in fed.sites
    }
    scorer = build_site_model(args, fed.test)
    g0 = get_params(scorer)
    notes: list[str] = []
    if method.statistics:
        notes += _statistics_phase(trainers, kind, keys)
    backend = EncryptedGlobalModel(keys.public, g0) if method.he else PlaintextBackend(g0)
    scheme = get_scheme(method.scheme, **method.scheme_args)
    guards, guards_note = mode_safeguards(mode, method.he)
    step = RoundStep(scheme, backend, num_rounds=ROUNDS, safeguards=guards, log=lambda m: None)
    memory: dict = {}
    stalled, weight = [], 0.0
    left_out = bounded = 0
    g = g0
    with tempfile.TemporaryDirectory() as records:
        recorder = RoundRecorder(records, method.scheme)  # the controller's records, written every round
        for t in range(1, ROUNDS + 1):
            if method.he:
                g, _ = decode_global(keys.secret, backend.task_params(), backend.meta(), g0, SITE_MIN)
            else:
                g = backend.task_params()
            plan = step.plan(method.scheme, method.scheme_args)
            results = []
            for site, trainer in trainers.items():
                try:
                    out = trainer.run_round(g, t - 1, plan, total_rounds=ROUNDS)
                except Exception as e:  # a site that fails sends nothing, as in a job
                    notes.append(f"{site} failed in round {t}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                params = (
                    encode_update(keys.secret, out.params, g, backend.layout) if method.he else out.params
                )
                meta = {
                    META_NUM_SAMPLES: out.num_samples,
                    META_NUM_STEPS: out.num_steps,
                    META_SCALARS: out.scalars,
                    META_MIN_SECURE_SUM: SITE_MIN,
                }
                result = ClientResult(site, params, meta, out.metrics)
                if site in attackers and kind is not None:
                    result = _tamper(kind, result, g, t, memory, keys)
                results.append(result)
            outcome = step.run(t, results, list(SITES))
            recorder.add_outcome(outcome)
            recorder.flush()
            left_out += len(outcome.excluded)
            bounded += len(outcome.bounded)
            if not outcome.updated:
                stalled.append(t)
            for site in attackers:
                for note in (outcome.excluded.get(site), outcome.bounded.get(site)):
                    if note:
                        notes.append(note)
            if results:
                unasked = set(results[-1].meta.get(META_SCALARS, {})) - set(step.scalars)
                if unasked:
                    notes.append(
                        f"unasked scalar(s) {sorted(unasked)} dropped unread (the server computes or does not use them)"
                    )
            weight = max(weight, sum(outcome.weights.get(site, 0.0) for site in attackers))
        recorder.close()
    if method.he:
        final, _ = decode_global(keys.secret, backend.task_params(), backend.meta(), g0, SITE_MIN)
    else:
        final = backend.task_params()
    set_params(scorer, final)
    try:
        auc = float(evaluate(scorer, fed.test)["auc"])
    except ValueError as e:  # e.g. scikit-learn refusing NaN scores
        notes.append(f"the final global model cannot be evaluated: {e}")
        auc = float("nan")
    completed = bool(np.isfinite(auc))
    if not completed:
        notes.append("the final global model gives non-finite outputs")
    return RunResult(
        completed,
        stalled,
        notes,
        weight,
        auc,
        time.perf_counter() - start,
        left_out=left_out,
        bounded=bounded,
        safeguards_note=guards_note,
    )


# --------------------------------------------------------------------------------------- simulator
def run_in_simulator(kind: str | None, workdir: Path, mode: str = "deploy") -> RunResult:
    from fedweigh.cli import find_server_app_dir, simulator_command
    from fedweigh.flare.recipes import FedweighRecipe
    from fedweigh.server.records import load_rows
    from fedweigh.server.safeguards import ROBUST_OPTIONS

    start = time.perf_counter()
    name = f"attack_{kind or 'clean'}".replace("-", "_")
    guards = SAFEGUARDS[mode]
    options = {
        k: getattr(guards, k)
        for k in ("max_share", "update_norm_bound", "min_update_cosine", *ROBUST_OPTIONS)
    }
    recipe = FedweighRecipe(
        name=name,
        scheme="fedavg",
        num_rounds=ROUNDS,
        min_clients=2,
        client=ARGS,
        train_timeout=TRAIN_TIMEOUT,
        **options,
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
    """The distinct reasons (site names removed; notes that differ only in their figures, such as the
    norms of each round, counted once with the number of rounds)."""
    import re

    groups: dict[str, list[str]] = {}
    for note in notes:
        text = re.sub(r"site-\d+:? ", "", note)
        groups.setdefault(re.sub(r"[-+]?\d[\d.e+]*", "#", text), []).append(text)
    parts = [
        texts[0] + (f" (and so in {len(texts) - 1} more round(s))" if len(texts) > 1 else "")
        for texts in groups.values()
    ]
    return "; ".join(parts) if parts else "-"


def attack_row(attack: Attack, run: RunResult, clean: RunResult, he: bool = False) -> dict:
    """One attack's row of the results (the HE attacks file makes its rows with this too)."""
    failed = not run.completed or bool(run.stalled_rounds)
    drop = clean.auc - run.auc if run.completed else float("nan")
    return {
        "attack": attack.name,
        "method": attack.method,
        "family": FAMILY.get(attack.method, "-"),
        "path": attack.path,
        "attackers": list(attack.attackers),
        "he": bool(he or "HE" in attack.path),
        "completed": run.completed,
        "stalled_rounds": run.stalled_rounds,
        "crashed_or_stalled": failed,
        "why": _why(run.notes),
        "attacker_max_weight": round(run.attacker_weight, 4),
        "auc": round(run.auc, 4),
        "clean_auc": round(clean.auc, 4),
        "auc_drop": round(drop, 4),
        "seconds": round(run.seconds, 1),
        **({"safeguards_note": run.safeguards_note} if run.safeguards_note else {}),
        **({"error": run.error} if run.error else {}),
    }


def summarise(rows: list[dict]) -> dict:
    """Attacks tried, crashed or stalled, and the worst AUC drop of one site and of two colluders in
    plaintext and of the HE attacks (None where none completed; a crash or stall is counted, not
    given a drop)."""

    def worst(selected: list[dict]) -> float | None:
        drops = [r["auc_drop"] for r in selected if r["completed"] and np.isfinite(r["auc_drop"])]
        return round(max(drops), 4) if drops else None

    plain = [r for r in rows if not r["he"]]
    return {
        "tried": len(rows),
        "crashed_or_stalled": sum(r["crashed_or_stalled"] for r in rows),
        "worst_auc_drop_one_site": worst([r for r in plain if len(r["attackers"]) == 1]),
        "worst_auc_drop_two_colluders": worst([r for r in plain if len(r["attackers"]) == 2]),
        "worst_auc_drop_he": worst([r for r in rows if r["he"]]),
    }


def summary_line(s: dict) -> str:
    """The last line of a run: ``attacks: N tried, C crashed or stalled, worst AUC drop D (one site),
    E (two colluders), H (HE)``."""

    def show(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.4f}"

    return (
        f"attacks: {s['tried']} tried, {s['crashed_or_stalled']} crashed or stalled, worst AUC drop "
        f"{show(s['worst_auc_drop_one_site'])} (one site), {show(s['worst_auc_drop_two_colluders'])} "
        f"(two colluders), {show(s['worst_auc_drop_he'])} (HE)"
    )


def markdown_table(record: dict) -> str:
    """The results of a run (its JSON) as the table of docs/security.md (files written before the
    columns ``family``, ``attackers`` and ``he`` existed read as one attacker, plaintext unless the path
    says HE)."""
    for r in record["attacks"]:
        r.setdefault("attackers", [ATTACKER])
        r.setdefault("he", "HE" in r["path"])
        r.setdefault("family", FAMILY.get(r["method"], "-"))
    record = {**record, "summary": summarise(record["attacks"])}
    lines = [
        "| attack | family | path | attackers | completed, no stall | left out or bounded, and why "
        "| largest weight of the attackers | AUC | clean AUC | AUC drop |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record["attacks"]:
        done = "yes" if r["completed"] and not r["crashed_or_stalled"] else "**NO**"
        why = r["why"].replace("|", "/")
        if len(why) > 400:
            why = why[:400] + " ..."
        auc = "-" if not np.isfinite(r["auc"]) else f"{r['auc']:.4f}"
        drop = "-" if not np.isfinite(r["auc_drop"]) else f"{r['auc_drop']:+.4f}"
        lines.append(
            f"| {r['attack']} | {r['family']} ({r['method']}) | {r['path']} | {len(r['attackers'])} | {done} "
            f"| {why} | {r['attacker_max_weight']:.3f} | {auc} | {r['clean_auc']:.4f} | {drop} |"
        )
    lines += ["", summary_line(record["summary"])]
    return "\n".join(lines)


def _he_rows(fed, keys: Keys, mode: str) -> list[dict]:
    """The rows of benchmarks/attacks_he.py's ``run_he_attacks``."""
    rows = attacks_he.run_he_attacks(fed, defences=mode != "off")  # its own HE keys; the sites' checks on
    return [
        {
            "method": "fedavg",
            "family": FAMILY.get("fedavg", "-"),
            "attackers": [attacks_he.ATTACKER],
            "attacker_max_weight": float("nan"),  # under HE the server never sees the weights' effect
            **r,
            "he": True,
        }
        for r in rows
    ]


def _write(ns: argparse.Namespace, rows: list[dict], clean: dict, summary: dict, complete: bool) -> None:
    """The run's JSON (``complete`` false while attacks remain)."""
    command = f"PYTHONPATH=custom .venv/bin/python benchmarks/bench_attacks.py --safeguards {ns.safeguards}"
    flags = [
        *(["--skip-simulator"] if ns.skip_simulator else []),
        *(["--issue-25"] if ns.issue_25 else []),
        *([f"--rounds {ns.rounds}"] if ns.rounds != 5 else []),
        *([f"--only '{ns.only}'"] if ns.only else []),
    ]
    record = {
        "command": " ".join([command, *flags, f"--out {ns.out}"]),
        "complete": complete,
        "settings": {
            "client": {
                k: v
                for k, v in vars(ARGS).items()
                if k in ("dataset", "scenario", "num_images", "size", "max_steps", "batch_size")
            },
            "sites": list(SITES),
            "attacker": ATTACKER,
            "colluders": list(PAIR),
            "rounds": ROUNDS,
            "safeguards": ns.safeguards,
            "safeguard_options": {k: v for k, v in vars(SAFEGUARDS[ns.safeguards]).items() if k != "limits"},
            "bound_factor": BOUND_FACTOR,
            "forged_count_factor": FORGED_COUNT,
            "server_secure_sum_floor": SERVER_FLOOR,
            "site_policy_min_secure_sum": SITE_MIN,
            "train_timeout_s": TRAIN_TIMEOUT,
            "python": sys.version.split()[0],
            "torch_threads": torch.get_num_threads(),
        },
        "clean_auc": {k: round(v.auc, 4) for k, v in clean.items()},
        "attacks": rows,
        "summary": summary,
    }
    atomic_write_text(Path(ns.out), json.dumps(record, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        default=None,
        help="JSON file for the results (e.g. docs/results/security/attacks-deploy.json)",
    )
    parser.add_argument(
        "--safeguards",
        choices=tuple(SAFEGUARDS),
        default="deploy",
        help="the server's settings: deploy (the defaults a job gets), off, or robust (module docstring)",
    )
    parser.add_argument("--skip-simulator", action="store_true", help="run only the in-process attacks")
    parser.add_argument("--only", default=None, help="run only the attacks whose name contains this text")
    parser.add_argument(
        "--in-range",
        "--issue-25",
        dest="issue_25",
        action="store_true",
        help="run only the attacks with in-range values (BatchNorm, noise, classifier flip, forged steps, "
        "label-flip, FedDisco, site metrics, colluders), not the earlier malformed-result ones",
    )
    parser.add_argument("--rounds", type=int, default=5, help="training rounds per run (default 5)")
    parser.add_argument(
        "--markdown",
        nargs="+",
        default=None,
        help="print the table of results JSON files and exit (no run; several files: their rows "
        "together, an attack listed twice taken from the first file)",
    )
    ns = parser.parse_args(argv)
    if ns.markdown:
        records = [json.loads(Path(f).read_text()) for f in ns.markdown]
        rows, seen = [], set()
        for record in records:
            for r in record["attacks"]:
                key = (r["attack"], r["method"], len(r.get("attackers", [ATTACKER])))
                if key not in seen:
                    seen.add(key)
                    rows.append(r)
        print(markdown_table({**records[0], "attacks": rows}))
        return 0
    torch.set_num_threads(1)
    os.environ.setdefault("FEDWEIGH_CACHE", str(Path(tempfile.gettempdir()) / "fedweigh-bench-cache"))
    fed = build_federation(
        ARGS.scenario, ARGS.dataset, size=ARGS.size, seed=ARGS.seed, num_images=ARGS.num_images
    )
    keys = Keys()
    globals()["ROUNDS"] = ns.rounds  # every run of this process
    attacks = [
        a
        for a in (ATTACKS[FIRST_ISSUE_25:] if ns.issue_25 else ATTACKS)
        if not (ns.skip_simulator and a.path == "simulator") and (ns.only is None or ns.only in a.name)
    ]
    clean: dict[str, RunResult] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for attack in attacks:
            reference = "simulator" if attack.path == "simulator" else attack.method
            if reference not in clean:
                clean[reference] = (
                    run_in_simulator(None, Path(tmp), ns.safeguards)
                    if reference == "simulator"
                    else run_in_process(fed, reference, None, keys, ns.safeguards)
                )
                print(
                    f"clean {reference}: AUC {clean[reference].auc:.4f} ({clean[reference].seconds:.0f} s)",
                    flush=True,
                )
            try:
                if attack.path == "simulator":
                    run = run_in_simulator(attack.kind, Path(tmp), ns.safeguards)
                else:
                    run = run_in_process(
                        fed, attack.method, attack.kind, keys, ns.safeguards, attack.attackers
                    )
            except Exception as e:  # an attack that escapes every check is a crash of the job
                run = RunResult(
                    False, [], [f"the job crashed: {type(e).__name__}: {e}"], 0.0, float("nan"), 0.0
                )
            rows.append(attack_row(attack, run, clean[reference]))
            if ns.out:  # what has run so far, so that an interrupted run leaves its rows
                _write(ns, rows, clean, summarise(rows), complete=False)
            r = rows[-1]
            print(
                f"{attack.name[:50]:<50} {r['family']:<9} {len(attack.attackers)} {attack.path:<17} "
                f"ok={not r['crashed_or_stalled']!s:<5} weight={r['attacker_max_weight']:.3f} AUC {r['auc']:.4f} "
                f"(clean {r['clean_auc']:.4f}, drop {r['auc_drop']:+.4f})  {r['why'][:300]}",
                flush=True,
            )
    if ns.only is None:
        rows += _he_rows(fed, keys, ns.safeguards)
    summary = summarise(rows)
    if ns.out:
        _write(ns, rows, clean, summary, complete=True)
    print(summary_line(summary))
    return 0 if summary["crashed_or_stalled"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
