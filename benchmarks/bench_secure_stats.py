"""Time the secure label-statistics phase: 16 sites x 14 findings, CKKS (HEBuilder parameters).

Phase = every site encrypts its statistics vector v_k = [n_k1..n_k14, N_k, N_k c_k]
(``SecureExchange.encode``, including its local round-trip check and base64), the server checks
and sums the 16 ciphertexts (``check`` + ``sum``), every site decrypts the sum (``decode``). All
16 sites run one after another in this process, so the figure is the total CPU work of the phase.
Loading the contexts from disk is timed separately (each process does it once). Target: 2 s.

    cd /work/main && PYTHONPATH=custom .venv/bin/python benchmarks/bench_secure_stats.py [--sites 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from fedweigh.flare.keys import role_context_provider
from fedweigh.histograms import decode_sum, statistics_vector
from fedweigh.secure.contexts import (
    CLIENT_CONTEXT_FILE,
    CONTEXT_DIR_ENV,
    SERVER_CONTEXT_FILE,
    load_context,
    save_context_files,
)
from fedweigh.secure.exchange import META_CIPHERTEXT, SecureExchange

TARGET_S = 2.0
NUM_CLASSES = 14


def run_phase(vectors: list[np.ndarray]) -> dict[str, float]:
    """One statistics phase; returns seconds per step and the payload size."""
    length = vectors[0].size
    provider = role_context_provider()  # the keys named by CONTEXT_DIR_ENV, as an NVFlare process finds them
    clients = [SecureExchange(provider) for _ in vectors]
    for c in clients:  # contexts loaded before timing (once per process in a real run)
        c._context("client")
    server = SecureExchange(provider)
    server._context("server")

    t0 = time.perf_counter()
    payloads = {f"site-{k + 1}": c.encode(v) for k, (c, v) in enumerate(zip(clients, vectors, strict=True))}
    t1 = time.perf_counter()
    for site, payload in payloads.items():
        server.check(site, payload, length)
    total = server.sum(payloads, length)
    t2 = time.perf_counter()
    sums = [c.decode(total) for c in clients]
    t3 = time.perf_counter()

    true = np.sum(vectors, axis=0)
    for s in sums:
        got = decode_sum(s)
        assert got.class_counts.tolist() == true[:-2].astype(np.int64).tolist(), "wrong global counts"
        assert got.num_samples == int(true[-2]), "wrong global N"
    return {
        "encrypt": t1 - t0,
        "check+sum": t2 - t1,
        "decrypt": t3 - t2,
        "total": t3 - t0,
        "payload_kb": len(next(iter(payloads.values()))[META_CIPHERTEXT]) / 1024,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sites", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    rng = np.random.default_rng(0)
    vectors = []
    for _ in range(args.sites):
        n = int(rng.integers(1_000, 1_000_001))
        vectors.append(statistics_vector(rng.integers(0, n + 1, size=NUM_CLASSES), n))

    with tempfile.TemporaryDirectory() as tmp:
        server_path, client_path = save_context_files(tmp)
        os.environ[CONTEXT_DIR_ENV] = tmp
        t = time.perf_counter()
        load_context(client_path, role="client")
        load_client = time.perf_counter() - t
        t = time.perf_counter()
        load_context(server_path, role="server")
        load_server = time.perf_counter() - t
        runs = [run_phase(vectors) for _ in range(args.repeats)]

    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"secure statistics phase, {args.sites} sites x {NUM_CLASSES} findings, {os.cpu_count()} CPU cores")
    print(
        f"  context load: {CLIENT_CONTEXT_FILE} {load_client * 1e3:.1f} ms, {SERVER_CONTEXT_FILE} {load_server * 1e3:.1f} ms"
    )
    print(f"  payload per site: {med['payload_kb']:.0f} KiB of base64 ciphertext")
    print(
        f"  encrypt {med['encrypt']:.3f} s | check+sum {med['check+sum']:.3f} s | decrypt {med['decrypt']:.3f} s"
        f" (median of {args.repeats})"
    )
    print(f"  total {med['total']:.3f} s; target {TARGET_S:.1f} s; ratio {med['total'] / TARGET_S:.3f}")
    with_loading = med["total"] + args.sites * load_client + load_server
    print(
        f"  total incl. loading every context once: {with_loading:.3f} s; ratio {with_loading / TARGET_S:.3f}"
    )


if __name__ == "__main__":
    main()
