"""Our controller with FedAvg weights and stock NVFlare FedAvg give the same global model."""

from __future__ import annotations

import os
import subprocess
from dataclasses import asdict

import numpy as np
import pytest
from simulation import TINY_CLIENT as CLIENT
from simulation import TINY_ROUNDS as ROUNDS
from simulation import saved_float_params

from fedweigh.cli import simulator_command
from fedweigh.flare.recipes import CLIENT_SCRIPT, ModelSpec
from fedweigh.models import FedweighNet

# In the tiny setting every site holds 90 training images and takes 4 steps per round, so stock
# FedAvg's step-count weights and fedweigh's N_k / N weights are both 1/2 for two sites.


@pytest.mark.slow
def test_fedavg_weights_match_stock_fedavg_after_three_rounds(tmp_path, method_run):
    from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe

    rows, app = method_run("fedavg")
    assert [r["weights"] for r in rows if "weights" in r] == [{"site-1": 0.5, "site-2": 0.5}] * ROUNDS

    stock = FedAvgRecipe(
        name="stock_fedavg",
        model={"class_path": "fedweigh.models.FedweighNet", "args": asdict(ModelSpec(seed=CLIENT.seed))},
        min_clients=2,
        num_rounds=ROUNDS,
        train_script=CLIENT_SCRIPT,
        train_args=CLIENT.to_argv(),
        key_metric="val_auc",
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
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    stock_model = next(ws.rglob("FL_global_model.pt"))

    a, b = saved_float_params(app / "FL_global_model.pt"), saved_float_params(stock_model)
    # stock FedAvg averages BatchNorm's integer step counters into floats; compare the float tensors
    b = {k: v for k, v in b.items() if not k.endswith("num_batches_tracked")}
    assert a.keys() == b.keys()
    worst = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
    assert worst <= 1e-6, f"largest difference {worst}"
    # and the models did train: they moved away from the initial weights
    initial = FedweighNet(**asdict(ModelSpec(seed=CLIENT.seed))).state_dict()
    assert max(float(np.max(np.abs(a[k] - initial[k].numpy()))) for k in a) > 1e-3
