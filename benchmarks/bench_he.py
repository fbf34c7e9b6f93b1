"""HE model updates vs plaintext: round wall time on a DenseNet job, and DenseNet121 costs per update.

Part 1 (compact DenseNet, the SynthCXR jobs' model and data: 4 hospitals, quantity-shift, one local
epoch). Everything runs in this process, one site after another, with the code the NVFlare client
and controller run:

- plaintext round: each site's ``SiteTrainer.run_round`` (evaluate + local training), then the
  server's round step (``RoundStep`` with the plaintext backend);
- HE round (the global model already encrypted, i.e. round >= 2): each site decrypts the global
  model (``decode_global``), trains (the same training, timed once above), encrypts its update
  (``encode_update``); the server checks the ciphertexts and forms Enc(theta_g) + sum_k w_k
  Enc(Delta_k) (``EncryptedGlobalModel.check_params`` + ``weigh`` + ``aggregate``).

Times are CPU seconds of this process (``--wall``: wall clock), robust to other work on a shared
machine. Round wall time of a federation whose sites work in parallel:
    plaintext: max_k train_k + server_plain;   HE: max_k (decrypt_k + train_k + encrypt_k) + server_HE.
The ratio HE / plaintext is printed against the target 2.7 (the overhead NVFlare reports for its own
HE FedAvg), for full encryption and for selective layer encryption. Network transfer is not timed;
the payload sizes are printed instead. The "all work" ratio sums every site's and the server's CPU
time (what one machine pays when it simulates the whole federation).

Part 2 (``--densenet121``): MONAI DenseNet121 (7.0M values) with a random update: seconds to encrypt
one update, to check and add it at the server (per site), to decrypt the global model, and sizes;
then a projected round ratio from these costs and a measured DenseNet121 SGD step (64 px, batch 32)
for ``--sites`` sites of ``--dn121-steps`` local steps (sites in parallel, server work per site).

    cd /work/main && PYTHONPATH=custom .venv/bin/python benchmarks/bench_he.py [--num-images 12000]
        [--epochs 1] [--max-steps N] [--repeats 3] [--densenet121 [--sites 4] [--dn121-steps 100]]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import asdict

import numpy as np

from fedweigh.secure.contexts import context_from_bytes, make_context, serialize_context
from fedweigh.secure.updates import decode_global, encode_update
from fedweigh.server.encrypted import EncryptedContribution, EncryptedGlobalModel
from fedweigh.weighting import ClientReport, get_scheme

TARGET_RATIO = 2.7
#: Selective-encryption settings compared with full encryption (compact DenseNet parameter names).
SELECTIVE = {
    "first+last layers": ["net.features.conv0.*", "net.class_layers.*"],
    "8 largest + classifier": ["largest:8", "net.class_layers.*"],
}


#: The clock of every figure: this process's CPU time (all its threads), which the other work on a shared
#: machine does not inflate; ``--wall`` switches to wall-clock time. Training runs on one torch thread and
#: every CKKS operation here on one ciphertext at a time, so CPU time is the wall time of an idle machine.
CLOCK = {"fn": time.process_time}


def timed(fn, repeats: int):
    """(median seconds, last result) of ``repeats`` calls of fn()."""
    clock = CLOCK["fn"]
    times, out = [], None
    for _ in range(repeats):
        t0 = clock()
        out = fn()
        times.append(clock() - t0)
    return statistics.median(times), out


def contexts():
    secret = make_context()
    public = context_from_bytes(serialize_context(secret, with_secret_key=False), role="server")
    return secret, public


def nbytes(params: dict) -> int:
    return int(sum(np.asarray(v).nbytes for v in params.values()))


# ------------------------------------------------------------------------------------------ part 1
def part1(args: argparse.Namespace) -> None:
    import torch

    from fedweigh.data import build_federation
    from fedweigh.flare.recipes import ModelSpec
    from fedweigh.models import FedweighNet
    from fedweigh.server.rounds import ClientResult, PlaintextBackend, RoundStep
    from fedweigh.site.args import ClientArgs
    from fedweigh.site.trainer import SiteTrainer
    from fedweigh.train import get_params

    torch.set_num_threads(1)
    client = ClientArgs(
        dataset="synthcxr",
        scenario="quantity-shift",
        num_images=args.num_images,
        epochs=args.epochs,
        max_steps=args.max_steps,
        eval_test=False,
    )
    fed = build_federation(client.scenario, client.dataset, num_images=client.num_images, seed=client.seed)
    trainers = [SiteTrainer(site, fed.test, client, threads=1) for site in fed.sites]
    g0 = get_params(FedweighNet(**asdict(ModelSpec(seed=client.seed))))
    scheme_name = "feddraw"
    scheme = get_scheme(scheme_name)
    plan = RoundStep(scheme, PlaintextBackend(g0), num_rounds=5).plan(scheme_name, {})

    train_s, outs = [], []
    for tr in trainers:
        t, out = timed(lambda tr=tr: tr.run_round(g0, 0, plan), 1)
        outs.append(out)
        train_s.append(t)
    reports = [
        ClientReport(tr.site_name, o.num_samples, o.num_steps, o.scalars, o.params)
        for tr, o in zip(trainers, outs, strict=True)
    ]
    results = [
        ClientResult(
            r.name,
            r.params,
            {
                "num_samples": r.num_samples,
                "NUM_STEPS_CURRENT_ROUND": r.num_steps,
                "fedweigh_scalars": r.scalars,
            },
        )
        for r in reports
    ]
    server_plain, _ = timed(
        lambda: RoundStep(get_scheme(scheme_name), PlaintextBackend(g0), num_rounds=5).run(2, results),
        args.repeats,
    )
    steps = [o.num_steps for o in outs]
    print(
        f"compact DenseNet ({sum(v.size for v in g0.values())} values), {len(trainers)} sites, "
        f"{client.num_images} images, local steps {steps}, scheme {scheme_name}"
    )
    print(
        f"plaintext: train per site {', '.join(f'{t:.2f}' for t in train_s)} s; server weights+aggregate "
        f"{server_plain:.3f} s; update {nbytes(g0) / 1e6:.2f} MB"
    )
    plain_round = max(train_s) + server_plain
    plain_all = sum(train_s) + server_plain

    secret, public = contexts()
    for label, layers in {"all float arrays": None, **SELECTIVE}.items():
        he = measure_he(
            secret, public, g0, [o.params for o in outs], reports, layers, scheme_name, args.repeats
        )
        he_round = (
            max(he["decrypt"] + t + e for t, e in zip(train_s, he["encrypt"], strict=True)) + he["server"]
        )
        he_all = len(train_s) * he["decrypt"] + sum(train_s) + sum(he["encrypt"]) + he["server"]
        print(
            f"HE, {label}: {he['arrays']} arrays / {he['values']} values encrypted in {he['chunks']} ciphertexts; "
            f"per site decrypt {he['decrypt']:.3f} s, encrypt {statistics.mean(he['encrypt']):.3f} s; server "
            f"check+aggregate {he['server']:.3f} s; update up {he['up_mb']:.2f} MB, global down {he['down_mb']:.2f} MB"
        )
        print(
            f"    round wall time (parallel sites): plaintext {plain_round:.2f} s, HE {he_round:.2f} s, "
            f"ratio {he_round / plain_round:.2f}x (target <= {TARGET_RATIO}); all work: ratio "
            f"{he_all / plain_all:.2f}x"
        )


def he_aggregate(server, scheme, reports, contributions, t: int, num_rounds: int = 5):
    """The round step's weigh + aggregate on the CKKS backend (the server's encrypted sum)."""
    return server.aggregate(
        scheme, reports, contributions, server.weigh(scheme, reports, contributions, t, num_rounds)
    )


def measure_he(secret, public, g0, trained, reports, layers, scheme_name: str, repeats: int) -> dict:
    """HE costs of one round that starts from an encrypted global model (round >= 2)."""
    server = EncryptedGlobalModel(public, g0, layers)
    blind = [ClientReport(r.name, r.num_samples, r.num_steps, r.scalars) for r in reports]
    # round 1 (plaintext initial model), so that the timed round starts from an encrypted global model
    first = [encode_update(secret, p, g0, server.layout) for p in trained]
    contributions = [server.check_params(r.name, p) for r, p in zip(blind, first, strict=True)]
    he_aggregate(server, get_scheme(scheme_name), blind, contributions, 1)
    meta, received = server.meta(), server.task_params()

    dec_s, (global_params, layout) = timed(lambda: decode_global(secret, received, meta, g0), repeats)
    enc_s, sent = [], []
    for p in trained:
        t, payload = timed(lambda p=p: encode_update(secret, p, global_params, layout), repeats)
        enc_s.append(t)
        sent.append(payload)

    def server_round() -> None:
        state = copy.copy(server)  # aggregate replaces attributes: every repeat starts from round 1's state
        received = [state.check_params(r.name, p) for r, p in zip(blind, sent, strict=True)]
        he_aggregate(state, get_scheme(scheme_name), blind, received, 2)

    server_s, _ = timed(server_round, repeats)
    return {
        "arrays": len(layout.keys),
        "values": layout.num_values,
        "chunks": layout.num_chunks,
        "decrypt": dec_s,
        "encrypt": enc_s,
        "server": server_s,
        "up_mb": nbytes(sent[0]) / 1e6,
        "down_mb": nbytes(received) / 1e6,
    }


# ------------------------------------------------------------------------------------------ part 2
def densenet121_step_seconds(img_size: int = 64, batch: int = 32) -> float:
    """Median seconds of one SGD step of MONAI DenseNet121 (14 outputs, 1 channel) on CPU."""
    import torch
    from monai.networks.nets import DenseNet121

    model = DenseNet121(spatial_dims=2, in_channels=1, out_channels=14)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.rand(batch, 1, img_size, img_size), torch.randint(0, 2, (batch, 14)).float()

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
        opt.step()

    step()  # warm-up
    return timed(step, 3)[0]


def part2(args: argparse.Namespace) -> None:
    import torch
    from monai.networks.nets import DenseNet121

    torch.set_num_threads(1)
    model = DenseNet121(spatial_dims=2, in_channels=1, out_channels=14)
    g0 = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(0)
    trained = {
        k: (v + rng.normal(0, 1e-3, v.shape).astype(v.dtype)) if v.dtype.kind == "f" else v + 1
        for k, v in g0.items()
    }
    secret, public = contexts()
    server = EncryptedGlobalModel(public, g0)
    layout = server.layout
    enc_s, sent = timed(lambda: encode_update(secret, trained, g0, layout), 1)
    check_s, contribution = timed(lambda: server.check_params("site-1", sent), 1)
    he_aggregate(server, get_scheme("fedavg"), [ClientReport("site-1", 100)], [contribution], 1)
    received, meta = server.task_params(), server.meta()  # the global model is now encrypted

    reports = [ClientReport(f"site-{i + 1}", 100) for i in range(args.sites)]
    same = [EncryptedContribution(r.name, contribution.update, contribution.clear) for r in reports]
    agg_s, _ = timed(lambda: he_aggregate(copy.copy(server), get_scheme("fedavg"), reports, same, 2), 1)
    dec_s, _ = timed(lambda: decode_global(secret, received, meta, g0), 1)
    server_s = args.sites * check_s + agg_s
    print(
        f"DenseNet121 ({layout.num_values} values, {layout.num_chunks} ciphertexts): site encrypts one update "
        f"in {enc_s:.2f} s and decrypts the global model in {dec_s:.2f} s; server: check {check_s:.2f} s per "
        f"site, weighted sum of {args.sites} updates {agg_s:.2f} s; update {nbytes(sent) / 1e6:.0f} MB up "
        f"(plaintext float32 {nbytes(g0) / 1e6:.0f} MB), global {nbytes(received) / 1e6:.0f} MB down"
    )
    step = densenet121_step_seconds()
    train = args.dn121_steps * step
    he = dec_s + train + enc_s + server_s
    print(
        f"    projected round, {args.sites} sites x {args.dn121_steps} local steps of {step:.2f} s (64 px, batch "
        f"32): plaintext {train:.0f} s, HE {he:.0f} s, ratio {he / train:.2f}x (target <= {TARGET_RATIO}); "
        "server work grows with the number of sites"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", type=int, default=12000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--densenet121", action="store_true", help="also time DenseNet121 updates")
    parser.add_argument("--sites", type=int, default=4, help="sites in the projected DenseNet121 round")
    parser.add_argument("--dn121-steps", type=int, default=100, help="local steps in that round")
    parser.add_argument("--wall", action="store_true", help="wall-clock instead of CPU time")
    args = parser.parse_args()
    if args.wall:
        CLOCK["fn"] = time.perf_counter
    print(f"clock: {'wall time' if args.wall else 'CPU time of this process'}")
    part1(args)
    if args.densenet121:
        part2(args)


if __name__ == "__main__":
    main()
