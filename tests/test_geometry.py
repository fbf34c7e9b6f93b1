"""Parameter geometry compares trainable parameters: buffers (BatchNorm running statistics) are left out.

Each scheme that compares parameters (FedDRAW in every similarity mode, FedAdp, IDA, FedAWA) must give
the same weights when only the clients' running statistics differ; with ``geometry="all"`` (every
floating-point array, the behaviour before buffers were excluded) the same change moves the weights.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedweigh.models import ARCHITECTURES, NORMS, build_model
from fedweigh.train import get_params
from fedweigh.weighting import ClientReport, get_scheme
from fedweigh.weighting.geometry import (
    direction_similarity,
    geometry_keys,
    is_buffer_name,
    model_buffer_keys,
    model_similarity,
    use_model_buffers,
)


def state(conv, bn_w, mean, var, count=3):
    return {
        "conv.weight": np.asarray(conv, dtype=np.float32),
        "bn.weight": np.asarray(bn_w, dtype=np.float32),
        "bn.running_mean": np.asarray(mean, dtype=np.float32),
        "bn.running_var": np.asarray(var, dtype=np.float32),
        "bn.num_batches_tracked": np.array(count, dtype=np.int64),
    }


GLOBAL = state([1.0, -0.5, 0.25, 2.0], [1.0, 1.0], [0.1, -0.1], [1.0, 1.0])
PREVIOUS = state([0.9, -0.4, 0.3, 1.9], [1.0, 0.9], [0.0, 0.0], [1.0, 1.0])
CLIENTS = [
    state([1.2, -0.4, 0.2, 2.1], [1.1, 0.9], [0.1, -0.2], [1.2, 0.8], 5),
    state([0.9, -0.6, 0.3, 1.8], [0.9, 1.2], [0.3, 0.1], [0.7, 1.1], 5),
    state([1.0, -0.3, 0.5, 2.2], [1.0, 1.05], [-0.1, 0.2], [1.1, 1.3], 5),
]


def with_other_statistics(params, factor):
    """The same parameters with running statistics moved far (what BatchNorm does on other data)."""
    out = dict(params)
    out["bn.running_mean"] = params["bn.running_mean"] + np.float32(5.0 * factor)
    out["bn.running_var"] = params["bn.running_var"] * np.float32(1.0 + 20.0 * factor)
    return out


def run(name, options, clients, rounds=2):
    """Weights of the last of ``rounds`` rounds (stateful schemes advance through the earlier ones)."""
    scheme = get_scheme(name, **options)
    if name == "feddraw" and options.get("similarity") == "direction":
        scheme.previous_global = dict(PREVIOUS)
    reports = [ClientReport(f"site-{i}", 100 * (i + 1), params=c) for i, c in enumerate(clients)]
    if name == "feddraw":  # one middle round (lambda = 1/2): the similarity counts
        return scheme.weights(reports, GLOBAL, 3, 5)
    w = None
    for t in range(1, rounds + 1):
        w = scheme.weights(reports, GLOBAL, t, 5)
    return w


SCHEMES = [
    ("feddraw", {"similarity": "params", "rho": 1.0}),
    ("feddraw", {"similarity": "layer", "rho": 1.0}),
    ("feddraw", {"similarity": "delta", "rho": 1.0}),
    ("feddraw", {"similarity": "direction", "rho": 1.0}),
    ("fedadp", {}),
    ("ida", {}),
    ("fedawa", {}),
]


@pytest.mark.parametrize(("name", "options"), SCHEMES, ids=lambda v: str(v))
def test_running_statistics_do_not_move_the_weights(name, options):
    moved = [with_other_statistics(CLIENTS[0], 1.0), *CLIENTS[1:]]
    same = run(name, options, CLIENTS)
    np.testing.assert_array_equal(run(name, options, moved), same)
    # the behaviour before: every floating-point array counted, and the statistics decided the weights
    everything = {**options, "geometry": "all"}
    assert np.max(np.abs(run(name, everything, moved) - run(name, everything, CLIENTS))) > 1e-5


def test_geometry_keys_trainable_all_and_exact_set():
    assert geometry_keys(GLOBAL) == ["conv.weight", "bn.weight"]
    assert geometry_keys(GLOBAL, "all") == ["conv.weight", "bn.weight", "bn.running_mean", "bn.running_var"]
    # a model's exact buffer set wins over the name rule (an EMA buffer the rule does not know)
    with_ema = {**GLOBAL, "ema.shadow": np.ones(2, dtype=np.float32)}
    assert "ema.shadow" in geometry_keys(with_ema)
    exact = {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "ema.shadow"}
    assert geometry_keys(with_ema, "trainable", exact) == ["conv.weight", "bn.weight"]
    assert is_buffer_name("features.denseblock1.norm.running_var") and not is_buffer_name("running_meanx")
    with pytest.raises(ValueError, match="no floating-point parameters"):
        geometry_keys({"bn.running_mean": np.zeros(2)})


@pytest.mark.parametrize("name", ["feddraw", "fedadp", "ida", "fedawa"])
def test_geometry_option_is_checked(name):
    with pytest.raises(ValueError, match=rf"{name}: geometry must be 'trainable'.*'all'.*got 'buffers'"):
        get_scheme(name, geometry="buffers")


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("norm", NORMS)
def test_name_rule_equals_every_models_own_buffers(arch, norm):
    """With a state dict alone the name rule leaves out exactly the model's buffers, so a site and a
    server that hold the model and one that does not compare the same arrays."""
    model = build_model(arch, num_classes=3, in_channels=1, img_size=32, norm=norm, seed=0)
    params = get_params(model)
    exact = model_buffer_keys(model)
    assert {k for k in params if is_buffer_name(k)} == exact
    trainable = [n for n, _ in model.named_parameters()]
    assert set(geometry_keys(params)) == set(trainable)
    assert geometry_keys(params, "trainable", exact) == geometry_keys(params)
    scheme = get_scheme("ida")
    use_model_buffers(scheme, model)
    assert scheme.buffer_keys == exact


def test_direction_similarity_by_hand_and_without_a_previous_update():
    g = {"w": np.array([1.0, 1.0, 0.0])}
    prev = {"w": np.array([0.0, 1.0, 0.0])}  # global update (1, 0, 0)
    client = {"w": np.array([2.0, 2.0, 0.0])}  # its update (1, 1, 0): 45 degrees
    assert direction_similarity(client, g, prev) == pytest.approx(1 / math.sqrt(2), rel=1e-15)
    assert direction_similarity(client, g, None) == 0.0
    assert direction_similarity(client, g, g) == 0.0  # the global model did not move: no direction
    with pytest.raises(ValueError, match="previous global model lacks"):
        direction_similarity(client, g, {"v": np.zeros(3)})


def test_model_similarity_over_trainable_keys_ignores_statistics():
    keys = geometry_keys(GLOBAL)
    moved = with_other_statistics(CLIENTS[0], 1.0)
    assert model_similarity(moved, GLOBAL, keys=keys) == model_similarity(CLIENTS[0], GLOBAL, keys=keys)
    assert model_similarity(moved, GLOBAL) != model_similarity(CLIENTS[0], GLOBAL)
