"""The fast federation engine: same numbers as before where the arithmetic is unchanged, less time.

In-memory batches equal the DataLoader's, site processes equal in-process sites, scoring every k
rounds leaves the training untouched, the client optimizer can persist, device selection, and a
sweep on a Dask cluster on loopback gives the local summary.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from fedweigh.bench import make_config, run_bench, run_cell
from fedweigh.bench.sites import LocalSites, SitePool, balance, make_sites
from fedweigh.data import build_federation
from fedweigh.data.base import LabeledImages
from fedweigh.models import build_model
from fedweigh.site.args import ClientArgs, parse_args
from fedweigh.site.trainer import SiteTrainer
from fedweigh.train import TensorBatches, make_loader, resolve_device, to_memory_format


def _data(n: int) -> LabeledImages:
    rng = np.random.default_rng(n)
    return LabeledImages(
        images=rng.random((n, 1, 4, 4)).astype(np.float32),
        labels=(rng.random((n, 3)) > 0.5).astype(np.float32),
        class_names=["a", "b", "c"],
        task="multilabel",
    )


@pytest.mark.parametrize(
    "n, batch, drop_last, epochs", list(itertools.product([33, 64], [8, 32], [False, True], [1, 3]))
)
def test_tensor_batches_are_the_dataloaders_batches(n, batch, drop_last, epochs):
    data = _data(n)
    loader, fast = (
        make_loader(data, batch, True, 5, drop_last),
        TensorBatches(data, batch, True, 5, drop_last),
    )
    want = [b for _ in range(epochs) for b in loader]
    got = [b for _ in range(epochs) for b in fast]
    assert len(fast) == len(loader) and len(got) == len(want)
    for (x1, y1), (x2, y2) in zip(want, got, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_channels_last_gives_the_same_outputs():
    x = torch.rand(4, 1, 32, 32)
    plain = build_model("densenet_compact", num_classes=14, in_channels=1, img_size=32, seed=0).eval()
    fast = to_memory_format(
        build_model("densenet_compact", num_classes=14, in_channels=1, img_size=32, seed=0), True
    )
    assert any(
        p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous()
        for p in fast.parameters()
    )
    with torch.no_grad():
        assert torch.allclose(
            plain(x), fast.eval()(x.contiguous(memory_format=torch.channels_last)), atol=1e-5
        )


def test_device_auto_and_bad_devices():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device must be one of"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")


def test_engine_options_reach_the_client_script():
    args = ClientArgs(keep_optimizer=True, channels_last=False, device="cpu", amp=True)
    assert parse_args(args.to_argv().replace("'", "").split()) == args


def _trainer(keep: bool) -> SiteTrainer:
    fed = build_federation("iid-4", "synthcxr", size=28, seed=0, num_images=240)
    args = ClientArgs(
        size=28, num_images=240, batch_size=16, max_steps=3, keep_optimizer=keep, eval_test=False
    )
    return SiteTrainer(fed.sites[0], fed.test, args, threads=1)


def test_the_client_optimizer_persists_across_rounds_when_asked():
    kept, fresh = _trainer(True), _trainer(False)
    g = {k: v.copy() for k, v in kept.run_round(_params(kept), 0, {}).params.items()}
    fresh.run_round(_params(fresh), 0, {})
    assert kept.optimizer is not None and fresh.optimizer is None
    step = float(next(iter(kept.optimizer.state.values()))["step"])  # 3 steps in round 1
    a = kept.run_round(g, 1, {})
    b = fresh.run_round(g, 1, {})
    # Adam's moments carried over: 6 steps counted, and round 2 moves differently from a fresh Adam
    assert step == 3 and float(next(iter(kept.optimizer.state.values()))["step"]) == 6
    assert any(
        not np.array_equal(a.params[k], b.params[k]) for k in a.params if a.params[k].dtype.kind == "f"
    )


def _params(trainer: SiteTrainer) -> dict:
    from fedweigh.train import get_params

    return get_params(trainer.model)


def _config(**kw):
    return make_config(
        "smoke", "synthcxr", methods=["fedbb"], scenarios=["quantity-a1.0"], rounds=3, max_steps=2, **kw
    )


@pytest.mark.slow
def test_site_processes_give_the_in_process_rows():
    serial, _, _ = run_cell(_config(), "quantity-a1.0", "fedbb", 0)
    pooled, _, _ = run_cell(_config(site_workers=2), "quantity-a1.0", "fedbb", 0)
    for a, b in zip(serial["rows"], pooled["rows"], strict=True):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if key in ("round_seconds",):
                continue
            if key == "weights":
                assert value == pytest.approx(b[key], abs=1e-12)
            elif isinstance(value, float) and np.isnan(value):
                assert np.isnan(b[key])
            else:
                assert value == pytest.approx(b[key], abs=1e-9), key


def test_site_workers_are_processes():
    fed = build_federation("iid-4", "synthcxr", size=28, seed=0, num_images=240)
    sites = make_sites(fed.sites, fed.test, ClientArgs(size=28, num_images=240), workers=2)
    try:
        assert isinstance(sites, SitePool) and len(sites._workers) == 2
        assert all(proc.is_alive() for proc, _ in sites._workers)
        assert sites.names == ["site-1", "site-2", "site-3", "site-4"]
        assert (
            make_sites(fed.sites[:2], fed.test, ClientArgs(size=28, num_images=240), workers=2) is sites
        )  # reused
        assert sites.names == ["site-1", "site-2"]
    finally:
        sites.close()
    assert isinstance(make_sites(fed.sites, fed.test, ClientArgs(size=28), workers=1), LocalSites)


def test_sites_are_balanced_over_workers():
    fed = build_federation("quantity-a0.3", "synthcxr", size=28, seed=0, num_images=240)
    groups = balance(fed.sites, 2)
    loads = sorted(sum(len(s.train) for s in g) for g in groups)
    assert sorted(s.name for g in groups for s in g) == sorted(s.name for s in fed.sites)
    biggest = max(len(s.train) for s in fed.sites)
    assert loads[-1] - loads[0] <= biggest


@pytest.mark.slow
def test_scoring_every_k_rounds_leaves_training_unchanged():
    every, _, _ = run_cell(_config(), "quantity-a1.0", "fedbb", 0)
    sparse, _, _ = run_cell(_config(eval_every=2), "quantity-a1.0", "fedbb", 0)
    rows = {r["round"]: r for r in sparse["rows"]}
    assert (
        "test_auc" in rows[0]
        and "test_auc" not in rows[1]
        and "test_auc" in rows[2]
        and "test_auc" in rows[3]
    )
    assert "val_auc" not in rows[1] and "train_loss" in rows[1]
    full = {r["round"]: r for r in every["rows"]}
    for t in (1, 2, 3):
        assert rows[t]["weights"] == full[t]["weights"]
    assert rows[3]["test_auc"] == full[3]["test_auc"]  # the same final model


@pytest.mark.slow
def test_a_sweep_on_a_dask_cluster_gives_the_local_summary(tmp_path):
    distributed = pytest.importorskip("distributed")
    config = make_config("smoke", "synthcxr", methods=["fedavg", "feddraw"], scenarios=["iid-4"], rounds=1)
    local = run_bench(config, tmp_path / "local", jobs=1, progress=False)
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None
    ) as cluster:
        remote = run_bench(config, tmp_path / "cluster", progress=False, cluster=cluster.scheduler_address)
    assert remote.trained == 2
    drop = ("wall_seconds", "cells_seconds")
    a = {k: v for k, v in local.summary.items() if k not in drop}
    b = {k: v for k, v in remote.summary.items() if k not in drop}
    assert json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)
