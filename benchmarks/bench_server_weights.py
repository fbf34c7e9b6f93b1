"""Time the server's work per round for every weighting scheme: weights() + aggregate().

Setting: 10 clients holding parameter dicts with the shapes of MONAI's DenseNet121 state dict
(spatial_dims=2, in_channels=1, out_channels=14: 727 arrays, about 7.0M float32 values, including
BatchNorm buffers), filled with random values; each client = global + small random delta. The
target is 1 s per scheme and round.

    cd /work/main && PYTHONPATH=custom .venv/bin/python benchmarks/bench_server_weights.py [--clients 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from fedweigh.histograms import global_stats_of
from fedweigh.weighting import SCHEMES, ClientReport, WeightingScheme, get_scheme
from fedweigh.weighting.base import ScalarContext

TARGET_S = 1.0
NUM_CLASSES = 14


def densenet121_shapes() -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shapes and dtypes of MONAI DenseNet121's state dict (built once, weights discarded)."""
    import torch
    from monai.networks.nets import DenseNet121

    torch.set_num_threads(1)
    model = DenseNet121(spatial_dims=2, in_channels=1, out_channels=NUM_CLASSES)
    return {
        k: (tuple(v.shape), np.dtype(str(v.dtype).removeprefix("torch.")))
        for k, v in model.state_dict().items()
    }


def random_params(shapes: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for key, (shape, dtype) in shapes.items():
        if np.issubdtype(dtype, np.floating):
            out[key] = rng.standard_normal(shape, dtype=np.float32)
        else:
            out[key] = np.full(shape, 100, dtype=dtype)
    return out


def client_params(global_params: dict, rng: np.random.Generator, scale: float) -> dict[str, np.ndarray]:
    out = {}
    for key, value in global_params.items():
        if np.issubdtype(value.dtype, np.floating):
            out[key] = value + np.float32(scale) * rng.standard_normal(value.shape, dtype=np.float32)
        else:
            out[key] = value + 7
    return out


def make_reports(
    scheme: WeightingScheme,
    global_params: dict,
    clients: list[dict],
    rng: np.random.Generator,
    *,
    scalars: bool,
) -> list[ClientReport]:
    """Reports as the clients would send them (client-side scalars computed outside the timing)."""
    reports = []
    hists = [rng.integers(0, 500, NUM_CLASSES) for _ in clients]
    sizes = [int(hist.max()) + 200 for hist in hists]
    pooled = global_stats_of(zip(hists, sizes, strict=True))  # what the statistics phase gives the sites
    for i, (params, hist, n) in enumerate(zip(clients, hists, sizes, strict=True)):
        sc = {}
        if scalars:
            sc = scheme.client_scalars(
                ScalarContext(
                    class_counts=hist,
                    num_samples=n,
                    global_stats=pooled,
                    params=params,
                    global_params=global_params,
                )
            )
        reports.append(ClientReport(f"site-{i + 1}", n, num_steps=50 + 10 * i, scalars=sc, params=params))
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    shapes = densenet121_shapes()
    global_params = random_params(shapes, rng)
    total = sum(v.size for v in global_params.values() if v.dtype.kind == "f")
    clients = [client_params(global_params, rng, 0.01 * (1 + i / args.clients)) for i in range(args.clients)]
    print(f"{args.clients} clients, {len(global_params)} arrays, {total / 1e6:.2f}M float values each")

    variants: list[tuple[str, str, dict, bool]] = [(name, name, {}, True) for name in SCHEMES]
    variants += [
        ("feddraw[server-side params]", "feddraw", {}, False),
        ("feddraw[server-side layer]", "feddraw", {"similarity": "layer"}, False),
        ("feddraw[delta]", "feddraw", {"similarity": "delta"}, False),
    ]
    print(f"{'scheme':30s} {'weights s':>10s} {'aggregate s':>12s} {'total s':>8s} {'/ target':>9s}")
    for label, name, options, with_scalars in variants:
        times_w, times_a = [], []
        for _ in range(args.repeats):
            scheme = get_scheme(name, **options)
            reports = make_reports(scheme, global_params, clients, rng, scalars=with_scalars)
            t0 = time.perf_counter()
            w = scheme.weights(reports, global_params, round_index=2, num_rounds=10)
            t1 = time.perf_counter()
            scheme.aggregate(global_params, reports, w)
            t2 = time.perf_counter()
            times_w.append(t1 - t0)
            times_a.append(t2 - t1)
        tw, ta = statistics.median(times_w), statistics.median(times_a)
        print(f"{label:30s} {tw:10.3f} {ta:12.3f} {tw + ta:8.3f} {(tw + ta) / TARGET_S:9.2f}")


if __name__ == "__main__":
    main()
