"""The cost of binding secure statistics sums to their job and exchange: one 4-site exchange (4 encodes, the
server's sum, one decode) of a 16-entry statistics vector with and without binding tags, with fresh
simulation keys; and the one-off derivation of the binding key.

    .venv/bin/python benchmarks/bench_stats_binding_cost.py
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from fedweigh.secure.contexts import CONTEXT_DIR_ENV, make_context, save_context_files

SITES = [f"site-{k}" for k in range(1, 5)]
VECTOR = np.arange(16, dtype=np.float64) * 37


def one_exchange_seconds(bound: bool, reps: int = 20) -> float:
    """Mean seconds of one exchange over ``reps`` exchanges (each with its own exchange id)."""
    from fedweigh.flare.keys import role_context_provider
    from fedweigh.histograms import META_EXCHANGE_ID, META_MEMBERS, ExchangeBinding
    from fedweigh.secure.exchange import SecureExchange

    client, server = SecureExchange(role_context_provider()), SecureExchange(role_context_provider())
    client.encode(VECTOR, ExchangeBinding("job-1", "warm-up-exchange-0", SITES[0]))  # contexts, key
    server.sum({"x": client.encode(VECTOR)}, VECTOR.size)
    t0 = time.perf_counter()
    for r in range(reps):
        exchange_id = f"exchange-{r:012d}"
        bindings = {s: ExchangeBinding("job-1", exchange_id, s) if bound else None for s in SITES}
        total = server.sum({s: client.encode(VECTOR, bindings[s]) for s in SITES}, VECTOR.size)
        client.decode({**total, META_MEMBERS: SITES, META_EXCHANGE_ID: exchange_id}, bindings[SITES[0]])
    return (time.perf_counter() - t0) / reps


def main() -> None:
    os.environ[CONTEXT_DIR_ENV] = keys = tempfile.mkdtemp()
    save_context_files(keys, make_context(), simulation=True)
    from fedweigh.flare.keys import role_context_provider
    from fedweigh.secure.exchange import binding_key

    t0 = time.perf_counter()
    binding_key(role_context_provider()("client"))
    derive = time.perf_counter() - t0
    unbound = min(one_exchange_seconds(False) for _ in range(2))
    bound = min(one_exchange_seconds(True) for _ in range(2))
    print(
        f"one exchange: unbound {1000 * unbound:.1f} ms, bound {1000 * bound:.1f} ms "
        f"(bound / unbound {bound / unbound:.3f}); binding key derivation (once per process): {1000 * derive:.1f} ms"
    )


if __name__ == "__main__":
    main()
