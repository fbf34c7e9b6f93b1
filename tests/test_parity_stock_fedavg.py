"""Our controller with FedAvg weights and stock NVFlare FedAvg weight the sites alike.

The two sites differ in size (the tiny setting: 112 and 72 training images), so FedAvg's weights
N_k / N are not 1/2 and a weighting error shows in the model. Both sites take the same 3 local steps;
stock FedAvg weighs a site by ``aggregation_weights[site] * NUM_STEPS_CURRENT_ROUND``, so it is given the
sites' sample counts as its aggregation weights. Our side runs the way the README shows from Python,
``recipe.execute(SimEnv(...))``; the stock side through ``nvflare simulator``.

The two do not sum alike: fedweigh forms theta_g + sum_k w_k (theta_k - theta_g) in float64 and rounds
once, stock FedAvg sums w_k theta_k in float32 in the order the results arrive. With unequal weights the
global models therefore differ by float32 rounding after each round, which local training carries on
(about 1e-3 after three rounds here). So each side is checked bit for bit against the same three rounds
computed in this process with the sites' own training code and the weights N_k / N taken from the data,
summed its way; and the two models are closer to each other than to the same training with equal weights.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict, replace

import numpy as np
import pytest
from simulation import TINY_CLIENT, saved_float_params

from fedweigh.cli import simulator_command
from fedweigh.flare.recipes import CLIENT_SCRIPT, ModelSpec
from fedweigh.models import FedweighNet
from fedweigh.server.records import load_rows

CLIENT = replace(TINY_CLIENT, optimizer="sgd", lr=0.01)
ROUNDS = 3
SITES = ("site-1", "site-2")

EXECUTE = """
from nvflare.recipe import SimEnv

from fedweigh.flare.recipes import BaselineRecipe
from fedweigh.site.args import ClientArgs

recipe = BaselineRecipe(baseline="fedavg", name="ours", num_rounds={rounds}, min_clients=2, client={client!r})
run = recipe.execute(SimEnv(num_clients=2, workspace_root={root!r}))
print("status:", run.get_status())
"""


def training_set_sizes() -> dict[str, int]:
    from fedweigh.site.data_config import resolve_site_data

    return {site: len(resolve_site_data(site, CLIENT)[0].train) for site in SITES}


def largest_difference(a: dict, b: dict) -> float:
    """Over the floating-point arrays (stock FedAvg averages BatchNorm's integer counters into floats)."""
    keys = [k for k in a if a[k].dtype.kind == "f" and not k.endswith("num_batches_tracked")]
    assert keys and all(k in b for k in keys)
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) for k in keys)


def fedweigh_sum(g: dict, trained: list[dict], w: np.ndarray) -> dict:
    """theta_g + sum_k w_k (theta_k - theta_g) in float64, rounded once (floating-point arrays)."""
    out = {}
    for key, value in g.items():
        g64 = value.astype(np.float64)
        acc = np.zeros_like(g64)
        for params, wk in zip(trained, w, strict=True):
            acc += (params[key] - g64) * wk
        out[key] = (acc + g64).astype(value.dtype)
    return out


def stock_sum(g: dict, trained: list[dict], w: np.ndarray) -> dict:
    """sum_k w_k theta_k / sum_k w_k as stock FedAvg forms it: in the arrays' own precision."""
    out = {}
    weights = [float(wk) for wk in w]  # Python floats: float32 arrays stay float32
    for key in g:
        total = trained[0][key] * weights[0]
        for params, wk in zip(trained[1:], weights[1:], strict=True):
            total = total + params[key] * wk
        out[key] = total * (1.0 / sum(weights))
    return out


def in_process(weights: np.ndarray, summed) -> dict:
    """The three rounds in this process: the sites' training code, the given weights, summed as given."""
    from fedweigh.models import FedweighNet
    from fedweigh.site.data_config import resolve_site_data
    from fedweigh.site.trainer import SiteTrainer
    from fedweigh.train import get_params

    trainers = [SiteTrainer(*resolve_site_data(s, CLIENT)[:2], CLIENT, threads=1) for s in SITES]
    g = get_params(FedweighNet(**asdict(ModelSpec(seed=CLIENT.seed))))
    for t in range(ROUNDS):
        trained = [tr.run_round(g, t, {}).params for tr in trainers]
        g = summed(g, trained, weights)
    return g


@pytest.mark.slow
def test_fedavg_weights_match_stock_fedavg_with_sites_of_different_sizes(tmp_path, monkeypatch):
    from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe

    monkeypatch.delenv("FEDWEIGH_SITE_CONFIG", raising=False)
    sizes = training_set_sizes()
    assert sizes == {"site-1": 112, "site-2": 72}
    total = sum(sizes.values())

    # ours, as the README shows: recipe.execute(SimEnv(...)) in a Python process of its own
    script = tmp_path / "execute_ours.py"
    script.write_text(EXECUTE.format(rounds=ROUNDS, client=CLIENT, root=str(tmp_path / "sim")))
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=420,
        cwd=tmp_path,
        start_new_session=True,  # as run_recipe_in_simulator: the simulator may end its process group
    )
    assert proc.returncode == 0 and "status:" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    (metrics,) = (tmp_path / "sim" / "ours").rglob("fedweigh_metrics.json")
    rows = load_rows(metrics)
    assert [r["round"] for r in rows] == list(range(ROUNDS + 1))
    for r in rows[1:]:
        assert r["weights"] == pytest.approx({s: n / total for s, n in sizes.items()}, abs=1e-12)
    ours = saved_float_params(metrics.parent / "FL_global_model.pt")
    n = np.array([sizes[s] for s in SITES], dtype=np.float64)
    assert largest_difference(ours, in_process(n / n.sum(), fedweigh_sum)) == 0.0

    stock = FedAvgRecipe(
        name="stock_fedavg",
        model={"class_path": "fedweigh.models.base.FedweighNet", "args": asdict(ModelSpec(seed=CLIENT.seed))},
        min_clients=2,
        num_rounds=ROUNDS,
        train_script=CLIENT_SCRIPT,
        train_args=CLIENT.to_argv(),
        key_metric="val_auc",
        aggregation_weights=dict(sizes),
    )
    stock.export(str(tmp_path / "stock_jobs"))
    ws = tmp_path / "stock_ws"
    proc = subprocess.run(
        simulator_command(tmp_path / "stock_jobs" / "stock_fedavg", ws, 2),
        capture_output=True,
        text=True,
        timeout=420,
        env={**os.environ},
        cwd=tmp_path,
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    stock_model = saved_float_params(next(ws.rglob("FL_global_model.pt")))
    steps = 3.0  # NUM_STEPS_CURRENT_ROUND of both sites (max_steps)
    assert largest_difference(stock_model, in_process(n * steps, stock_sum)) == 0.0

    # the two are the same weighting: closer to each other than to the same training with equal weights
    # (which a weighting error would give), and both trained away from the initial model
    equal = in_process(np.full(len(SITES), 0.5), fedweigh_sum)
    apart = largest_difference(ours, stock_model)
    print(
        f"max |ours - stock FedAvg| = {apart:.3g}, max |ours - equal weights| = {largest_difference(ours, equal):.3g}"
    )
    assert 10 * apart < largest_difference(ours, equal)
    assert 10 * apart < largest_difference(stock_model, equal)
    initial = {
        k: v.numpy() for k, v in FedweighNet(**asdict(ModelSpec(seed=CLIENT.seed))).state_dict().items()
    }
    assert largest_difference(ours, initial) > 1e-2
