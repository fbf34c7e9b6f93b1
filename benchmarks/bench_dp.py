"""Time a DP-SGD local epoch against a plain one, for each per-sample gradient implementation.

Model: the compact MONAI DenseNet (``densenet_compact``) with GroupNorm (DP-SGD cannot use
BatchNorm), 32 px single-channel images, 14 findings, batch 32, Adam, one epoch of N images
(N / 32 steps). Plain epoch: :func:`fedweigh.train.train_local` on the same GroupNorm model (and,
for reference, on the BatchNorm model a non-DP job uses). DP epoch: a whole
:meth:`fedweigh.secure.dp_sgd.DPSGD.train_round` (Poisson sampling, clipping, noise, accounting) with
sigma = 1, for each mode:

- ``fast``: fedweigh's layer hooks (no batch weight gradients, per-sample im2col products);
- ``hooks``, ``functorch``, ``ghost``: Opacus' grad-sample modes (ghost: fast gradient clipping,
  two backward passes; Opacus has no ghost norm for convolutions, so their per-sample gradients
  are instantiated anyway).

Before timing, every mode's noise-free clipped gradient of one batch is compared with Opacus'
hooks (relative L2 difference): a mode is "correct" below 1e-4. Configurations run interleaved,
``--repeats`` times; the figure is the minimum (least disturbed by other processes) of wall time
and of process CPU time. Target: DP epoch / plain epoch <= 2, on the CPU time of the training loop;
the per-round accounting (one RDP epsilon evaluation, whatever the number of steps) is timed and
printed separately.

Second part: how much Gaussian noise on the label statistics (:func:`fedweigh.secure.gaussian.privatize_histogram`)
moves the aggregation weights of the schemes that use them (CBR/FedBB skew, DAFL inverse imbalance,
FedDisco discrepancy) on a 16-site, 14-finding federation (site sizes 200-5000, prevalences drawn per
site), for several epsilons (delta 1e-5): mean over 200 draws of the L1 distance between the weight
vectors with exact and with noised statistics, and of the largest change of one site's weight.

    cd /work/main && PYTHONPATH=custom .venv/bin/python benchmarks/bench_dp.py [--images 1024] [--repeats 3]
"""

from __future__ import annotations

import os

# Poisson sampling gives batches of varying size; oneDNN caches one primitive per layer, pass and
# shape, at most 1,024 by default, which a DenseNet's 39 convolutions overflow after a few batch
# sizes, and then rebuilds its primitives at every step. The capacity is read once, before the first convolution; set
# ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024 to measure with oneDNN's default.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fedweigh.data.base import CHEST_FINDINGS, LabeledImages  # noqa: E402
from fedweigh.models import build_model  # noqa: E402
from fedweigh.secure.accountant import epsilon_for  # noqa: E402
from fedweigh.secure.dp_config import DPConfig, StatsDPConfig  # noqa: E402
from fedweigh.secure.dp_sgd import DPSGD  # noqa: E402
from fedweigh.secure.gaussian import privatize_histogram  # noqa: E402
from fedweigh.secure.grad_sample import clipped_mean_gradient  # noqa: E402
from fedweigh.train import TrainConfig, train_local  # noqa: E402
from fedweigh.weighting import ClientReport, get_scheme  # noqa: E402
from fedweigh.weighting.base import ScalarContext  # noqa: E402

TARGET_RATIO = 2.0
MODES = ("fast", "hooks", "functorch", "ghost")
CORRECT_TOL = 1e-4


def synthetic(n: int, size: int, seed: int = 0) -> LabeledImages:
    """Random images and labels with ~20% prevalence per finding."""
    rng = np.random.default_rng(seed)
    return LabeledImages(
        images=rng.random((n, 1, size, size), dtype=np.float32),
        labels=(rng.random((n, len(CHEST_FINDINGS))) < 0.2).astype(np.float32),
        class_names=list(CHEST_FINDINGS),
        task="multilabel",
    )


def check_modes(size: int, batch: int) -> dict[str, float]:
    """Relative L2 difference of each mode's clipped mean gradient from Opacus' hooks on one batch."""
    data = synthetic(batch, size, seed=1)
    x = torch.as_tensor(data.images)
    y = torch.as_tensor(data.labels)
    model = build_model("densenet_compact", len(CHEST_FINDINGS), img_size=size, norm="group", seed=0)
    ref = clipped_mean_gradient(model, x, y, "hooks", max_grad_norm=1.0)
    ref_norm = float(sum((g**2).sum() for g in ref.values()) ** 0.5)
    out = {}
    for mode in MODES:
        got = clipped_mean_gradient(model, x, y, mode, max_grad_norm=1.0)
        diff = float(sum(((got[k] - ref[k]) ** 2).sum() for k in ref) ** 0.5)
        out[mode] = diff / ref_norm
    return out


def stats_noise_effect(epsilons: list[float], draws: int = 200, sites: int = 16, seed: int = 0) -> None:
    """Print how much noised label statistics move CBR, DAFL and FedDisco weights (L1 and max change)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(200, 5001, size=sites)
    base = rng.uniform(0.01, 0.3, size=len(CHEST_FINDINGS))
    counts = [rng.binomial(n, np.clip(base * rng.lognormal(0.0, 0.7, base.size), 0, 0.95)) for n in sizes]
    schemes = {
        "cbr": get_scheme("cbr"),
        "dafl": get_scheme("dafl", mode="inverse_imbalance"),
        "feddisco": get_scheme("feddisco"),
    }

    def weights(hists: list[np.ndarray], ns: list[int]) -> dict[str, np.ndarray]:
        out = {}
        for name, scheme in schemes.items():
            # each scheme's scalar comes from the site's own (noised) histogram: CBR, DAFL and FedDisco's
            # default uniform target read no global statistics
            reports = [
                ClientReport(
                    name=f"site-{k + 1}",
                    num_samples=int(sizes[k]),  # N_k travels exactly with every training result
                    scalars=scheme.client_scalars(ScalarContext(class_counts=h, num_samples=n)),
                )
                for k, (h, n) in enumerate(zip(hists, ns, strict=True))
            ]
            out[name] = scheme.weights(reports, None, 1, 1)
        return out

    exact = weights(counts, [int(n) for n in sizes])
    print(
        f"\nstatistics DP: effect on weights, {sites} sites x {len(CHEST_FINDINGS)} findings, "
        f"N_k {sizes.min()}-{sizes.max()}, {draws} draws, delta 1e-5"
    )
    print(f"{'epsilon':>8} {'sigma':>7}  " + "  ".join(f"{n + ' L1':>12} {n + ' max':>12}" for n in schemes))
    for eps in epsilons:
        config = StatsDPConfig(epsilon=eps, delta=1e-5)
        l1: dict[str, list[float]] = {n: [] for n in schemes}
        mx: dict[str, list[float]] = {n: [] for n in schemes}
        sigma = 0.0
        for _ in range(draws):
            releases = [
                privatize_histogram(h, int(n), "multilabel", config, rng)
                for h, n in zip(counts, sizes, strict=True)
            ]
            sigma = releases[0].sigma
            noisy = weights([r.class_counts for r in releases], [r.num_samples for r in releases])
            for n in schemes:
                d = np.abs(noisy[n] - exact[n])
                l1[n].append(float(d.sum()))
                mx[n].append(float(d.max()))
        print(
            f"{eps:>8g} {sigma:>7.2f}  "
            + "  ".join(f"{np.mean(l1[n]):>12.4f} {np.mean(mx[n]):>12.4f}" for n in schemes)
        )


def time_epoch(
    kind: str, data: LabeledImages, cfg: TrainConfig, size: int
) -> tuple[float, float, int, float]:
    """(wall s, CPU s, steps, accounting CPU s) of one epoch; ``kind``: ``plain-group``, ``plain-batch`` or a DP mode.

    For DP the time is that of a whole :meth:`DPSGD.train_round`; its accounting part (the RDP
    accountant's epsilon for the round, once per round whatever the number of steps) is timed again
    on its own so that the training loop and the per-round accounting can be reported separately.
    """
    norm = "batch" if kind == "plain-batch" else "group"
    model = build_model("densenet_compact", len(CHEST_FINDINGS), img_size=size, norm=norm, seed=0)
    wall, cpu = time.perf_counter(), time.process_time()
    if kind.startswith("plain"):
        steps = train_local(model, data, cfg).num_steps
        return time.perf_counter() - wall, time.process_time() - cpu, steps, 0.0
    dp = DPSGD(DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, mode=kind), None, site_name="bench")
    result, report = dp.train_round(model, data, cfg)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    start = time.process_time()
    epsilon_for(report.history, report.delta)
    return wall, cpu, result.num_steps, time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--stats-epsilons", nargs="*", type=float, default=[0.5, 1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--skip-training", action="store_true", help="only the statistics part")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.skip_training:
        stats_noise_effect(args.stats_epsilons)
        return

    print(
        f"densenet_compact, GroupNorm, {args.size} px, batch {args.batch_size}, {args.images} images, "
        f"{args.threads} thread(s), {args.repeats} repeats (minimum reported), "
        f"ONEDNN_PRIMITIVE_CACHE_CAPACITY={os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY']}"
    )
    errors = check_modes(args.size, 8)
    print(
        "clipped gradient vs Opacus hooks (relative L2): " + ", ".join(f"{m} {errors[m]:.1e}" for m in MODES)
    )

    data = synthetic(args.images, args.size)
    cfg = TrainConfig(epochs=1, batch_size=args.batch_size, lr=1e-3, optimizer="adam", seed=0)
    kinds = ["plain-group", "plain-batch", *args.modes]
    walls: dict[str, list[float]] = {k: [] for k in kinds}
    cpus: dict[str, list[float]] = {k: [] for k in kinds}
    loops: dict[str, list[float]] = {k: [] for k in kinds}
    steps: dict[str, int] = {}
    for _ in range(args.repeats):
        for kind in kinds:
            w, c, s, acct = time_epoch(kind, data, cfg, args.size)
            walls[kind].append(w)
            cpus[kind].append(c)
            loops[kind].append(c - acct)
            steps[kind] = s

    base_wall, base_cpu = min(walls["plain-group"]), min(cpus["plain-group"])
    print(
        f"{'epoch':<12} {'steps':>5} {'wall s':>7} {'cpu s':>7} {'loop cpu s':>10} "
        f"{'loop ratio':>10} {'cpu ratio':>9} {'wall ratio':>10}  correct"
    )
    for kind in kinds:
        w, c, lp = min(walls[kind]), min(cpus[kind]), min(loops[kind])
        ok = "" if kind.startswith("plain") else ("yes" if errors[kind] < CORRECT_TOL else "NO")
        print(
            f"{kind:<12} {steps[kind]:>5} {w:>7.2f} {c:>7.2f} {lp:>10.2f} {lp / base_cpu:>10.2f} "
            f"{c / base_cpu:>9.2f} {w / base_wall:>10.2f}  {ok}"
        )
    print(
        "(cpu: process CPU time of the whole epoch / DP round; loop: without the round's accounting; "
        "ratios against plain-group)"
    )
    correct = [m for m in args.modes if errors[m] < CORRECT_TOL]
    best = min(correct, key=lambda m: min(loops[m]))
    ratio = min(loops[best]) / base_cpu
    print(
        f"fastest correct mode: {best}; DP epoch / plain epoch = {ratio:.2f} (CPU time of the training loop; "
        f"with the round's accounting {min(cpus[best]) / base_cpu:.2f}, wall {min(walls[best]) / base_wall:.2f}); "
        f"target <= {TARGET_RATIO:.1f}: {'met' if ratio <= TARGET_RATIO else 'NOT met'}"
    )
    if args.stats_epsilons:
        stats_noise_effect(args.stats_epsilons)


if __name__ == "__main__":
    main()
