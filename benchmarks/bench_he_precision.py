"""What rounding the decrypted HE values costs: the model's change and its test AUC, and the CKKS noise
the rounding stands above (fedweigh.secure.precision, docs/privacy.md "Decrypted values are rounded").

Part 1 (the rounding's cost). A short FedAvg run on SynthCXR (compact DenseNet, 4 sites, everything
in this process with the code the NVFlare client and controller run: ``SiteTrainer.run_round`` and
``RoundStep``), from the same start: the global model kept at full precision; rounded after every
aggregation to 2^-b for the default b and for the coarsest b allowed, as a site rounds what it
decrypts (the floating-point arrays: those HE encrypts); and, as the yardstick of how much any
perturbation that small moves this short run, with Gaussian noise of the CKKS decryption noise's size
(``--noise-sd``, the rms measured in part 2) added instead. Reported per run: the largest change made
to a global model, and each round's test AUC of the global model.

Part 2 (the noise). Encrypted updates of a model-sized vector summed with weights for ``--ckks-rounds``
rounds under NVFlare's HEBuilder parameters: the largest and rms decryption error after each round
(raw decryption - exact value, i.e. the noise the rounding removes), and the share of values whose
rounding to 2^-b the noise changes (the values whose rounded decryption still depends on the noise).

    PYTHONPATH=custom .venv/bin/python benchmarks/bench_he_precision.py \
        [--rounds 5] [--num-images 1200] [--max-steps 20] [--out docs/results/security/he-precision.json]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from fedweigh.io import atomic_write_text
from fedweigh.secure.precision import DEFAULT_PRECISION_BITS, MIN_PRECISION_BITS, round_decrypted


def rounded_floats(params: dict, bits: int | None) -> dict:
    """``params`` with every floating-point array rounded to 2^-bits (None: unchanged)."""
    if bits is None:
        return dict(params)
    out = {}
    for k, v in params.items():
        arr = np.asarray(v)
        out[k] = round_decrypted(arr, bits).astype(arr.dtype) if arr.dtype.kind == "f" else arr
    return out


def run_federation(args: argparse.Namespace, bits: int | None, noise_sd: float = 0.0) -> dict:
    """One FedAvg run with the global model rounded to 2^-bits after every aggregation (None: never), or
    with N(0, noise_sd^2) added to its floating-point values instead."""
    import torch

    from fedweigh.data import build_federation
    from fedweigh.flare.recipes import ModelSpec
    from fedweigh.models import FedweighNet
    from fedweigh.server.rounds import ClientResult, PlaintextBackend, RoundStep
    from fedweigh.site.args import ClientArgs
    from fedweigh.site.trainer import SiteTrainer
    from fedweigh.train import get_params, set_params
    from fedweigh.weighting import get_scheme

    torch.set_num_threads(1)
    client = ClientArgs(
        dataset="synthcxr",
        scenario="quantity-shift",
        num_images=args.num_images,
        max_steps=args.max_steps,
        threads=1,
    )
    fed = build_federation(client.scenario, client.dataset, num_images=client.num_images, seed=client.seed)
    trainers = [SiteTrainer(site, fed.test, client, threads=1) for site in fed.sites]
    g = get_params(FedweighNet(**asdict(ModelSpec(seed=client.seed))))
    step = RoundStep(get_scheme("fedavg"), PlaintextBackend(g), num_rounds=args.rounds)
    rows, max_change = [], 0.0
    for t in range(1, args.rounds + 1):
        plan = step.plan("fedavg", {})
        results = []
        for tr in trainers:
            out = tr.run_round(g, t - 1, plan)
            meta = {"num_samples": out.num_samples, "NUM_STEPS_CURRENT_ROUND": out.num_steps}
            results.append(ClientResult(tr.site_name, out.params, meta))
        exact = step.run(t, results).params
        g = rounded_floats(exact, bits)
        if noise_sd:
            rng = np.random.default_rng(1000 + t)
            g = {
                k: (v + rng.normal(0, noise_sd, np.shape(v))).astype(np.asarray(v).dtype)
                if np.asarray(v).dtype.kind == "f"
                else v
                for k, v in g.items()
            }
        change = max(
            float(np.abs(np.asarray(g[k], np.float64) - np.asarray(exact[k], np.float64)).max()) for k in g
        )
        max_change = max(max_change, change)
        set_params(trainers[0].model, g)
        metrics = trainers[0].evaluate()
        rows.append({"round": t, "test_auc": metrics["test_auc"], "max_abs_change": change})
        print(f"  b={bits}: round {t}: test AUC {metrics['test_auc']:.4f}, changed <= {change:.3g}")
    return {"bits": bits, "noise_sd": noise_sd, "rounds": rows, "max_abs_change": max_change}


def ckks_noise(args: argparse.Namespace) -> dict:
    """Decryption error of an encrypted global model over rounds, and the rounding it changes."""
    import tenseal as ts

    from fedweigh.secure.contexts import context_from_bytes, make_context, serialize_context
    from fedweigh.secure.updates import encrypt_chunks, weighted_sum

    rng = np.random.default_rng(0)
    secret = make_context()
    public = context_from_bytes(serialize_context(secret, with_secret_key=False), role="server")
    n = args.ckks_values
    exact = rng.normal(0, 0.3, n)
    base: object = exact.copy()
    rows = []
    for t in range(1, args.ckks_rounds + 1):
        deltas = [rng.normal(0, 0.01, n) for _ in range(4)]
        w = rng.dirichlet(np.ones(4))
        updates = [[ts.ckks_vector_from(public, c) for c in encrypt_chunks(secret, d)] for d in deltas]
        base = weighted_sum(updates, w, base)
        exact = exact + sum(wk * d for wk, d in zip(w, deltas, strict=True))
        raw = np.concatenate([np.asarray(ts.ckks_vector_from(secret, c.serialize()).decrypt()) for c in base])
        err = raw - exact
        row = {
            "round": t,
            "max_abs_noise": float(np.abs(err).max()),
            "rms_noise": float(np.sqrt(np.mean(err**2))),
        }
        for bits in (MIN_PRECISION_BITS, DEFAULT_PRECISION_BITS, 20):
            row[f"share_rounding_changed_by_noise_b{bits}"] = float(
                np.mean(round_decrypted(raw, bits) != round_decrypted(exact, bits))
            )
        rows.append(row)
        print(
            f"  CKKS round {t}: noise max {row['max_abs_noise']:.3g} rms {row['rms_noise']:.3g}; rounding "
            f"changed by the noise at b={DEFAULT_PRECISION_BITS}: "
            f"{row[f'share_rounding_changed_by_noise_b{DEFAULT_PRECISION_BITS}']:.4%}"
        )
    return {"values": n, "sites": 4, "rounds": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-images", type=int, default=1200)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--ckks-rounds", type=int, default=20)
    parser.add_argument("--ckks-values", type=int, default=16384)
    parser.add_argument("--noise-sd", type=float, default=2e-8, help="the yardstick run's noise")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    start = time.monotonic()
    runs = {}
    for label, bits, sd in (
        ("full precision", None, 0.0),
        ("default", DEFAULT_PRECISION_BITS, 0.0),
        ("coarsest", MIN_PRECISION_BITS, 0.0),
        ("CKKS-sized noise", None, args.noise_sd),
    ):
        print(f"{label} (b={bits}, noise {sd}):")
        runs[label] = run_federation(args, bits, sd)
    full = runs["full precision"]["rounds"]
    for label in ("default", "coarsest", "CKKS-sized noise"):
        diffs = [abs(a["test_auc"] - b["test_auc"]) for a, b in zip(runs[label]["rounds"], full, strict=True)]
        runs[label]["max_abs_test_auc_difference"] = max(diffs)
        print(
            f"{label}: changed the global model by at most {runs[label]['max_abs_change']:.3g}; "
            f"test AUC differs from full precision by at most {max(diffs):.2g}"
        )
    noise = ckks_noise(args)
    result = {
        "command": "PYTHONPATH=custom .venv/bin/python benchmarks/bench_he_precision.py "
        f"--rounds {args.rounds} --num-images {args.num_images} --max-steps {args.max_steps} "
        f"--ckks-rounds {args.ckks_rounds} --ckks-values {args.ckks_values} --noise-sd {args.noise_sd}",
        "setting": "FedAvg, SynthCXR quantity-shift, 4 sites, compact DenseNet, adam lr 1e-3, one torch thread",
        "default_bits": DEFAULT_PRECISION_BITS,
        "min_bits": MIN_PRECISION_BITS,
        "runs": runs,
        "ckks_noise": noise,
        "seconds": round(time.monotonic() - start, 1),
    }
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=2) + "\n", private=False)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
