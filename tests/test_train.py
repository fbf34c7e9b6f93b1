"""Local training loop, FedProx, determinism, prediction and the parameter exchange format."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedweigh.data.base import LabeledImages
from fedweigh.models import build_model
from fedweigh.train import (
    MaskedBCEWithLogitsLoss,
    TrainConfig,
    augment_batch,
    default_loss,
    evaluate,
    fedprox_term,
    get_params,
    make_loader,
    predict,
    set_params,
    train_local,
)

torch.set_num_threads(1)


class TinyNet(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(F.relu(self.conv(x))).flatten(1))


def separable(n: int = 64, task: str = "multilabel", seed: int = 0) -> LabeledImages:
    """Finding 0 = bright top half, finding 1 = bright bottom half (multi-class: which half, or none)."""
    rng = np.random.default_rng(seed)
    images = rng.uniform(0.0, 0.2, size=(n, 1, 16, 16)).astype(np.float32)
    if task == "multilabel":
        labels = (rng.random((n, 2)) < 0.5).astype(np.float32)
        images[labels[:, 0] == 1, :, :8] += 0.6
        images[labels[:, 1] == 1, :, 8:] += 0.6
        return LabeledImages(images, labels, ("top", "bottom"), "multilabel")
    labels = rng.integers(0, 3, size=n).astype(np.int64)
    images[labels == 1, :, :8] += 0.6
    images[labels == 2, :, 8:] += 0.6
    return LabeledImages(images, labels, ("none", "top", "bottom"), "multiclass")


def fresh(num_classes: int = 2, seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet(num_classes)


@pytest.mark.parametrize("task", ["multilabel", "multiclass"])
def test_training_decreases_loss_on_a_separable_problem(task: str) -> None:
    data = separable(task=task)
    model = fresh(data.num_classes)
    before = evaluate(model, data)
    result = train_local(model, data, TrainConfig(epochs=15, batch_size=16, lr=0.03))
    after = evaluate(model, data)
    assert result.num_steps == 15 * 4 and result.num_samples == 15 * 64
    assert after["loss"] < 0.5 * before["loss"]
    assert after["auc"] > 0.95
    assert np.isfinite(result.mean_loss)


def test_steps_samples_and_max_steps() -> None:
    data = separable(n=10)
    res = train_local(fresh(), data, TrainConfig(epochs=2, batch_size=4))
    assert (res.num_steps, res.num_samples) == (6, 20)  # batches of 4, 4, 2 per epoch
    res = train_local(fresh(), data, TrainConfig(epochs=5, batch_size=4, max_steps=4))
    assert (res.num_steps, res.num_samples) == (4, 14)  # 4 + 4 + 2, then 4 of the second epoch
    res = train_local(fresh(), data, TrainConfig(epochs=0))
    assert res.num_steps == 0 and np.isnan(res.mean_loss)


def test_same_seed_gives_identical_parameters() -> None:
    data = separable(n=24)
    cfg = TrainConfig(epochs=2, batch_size=8, seed=3, augment=True)
    runs = []
    for _ in range(2):
        model = fresh()
        train_local(model, data, cfg)
        runs.append(get_params(model))
    assert all(np.array_equal(runs[0][k], runs[1][k]) for k in runs[0])
    other = fresh()
    train_local(other, data, TrainConfig(epochs=2, batch_size=8, seed=4, augment=True))
    assert not np.array_equal(get_params(other)["fc.weight"], runs[0]["fc.weight"])


def test_fedprox_term_value_and_pull_towards_global() -> None:
    model = fresh()
    global_params = {k: v - 1.0 for k, v in get_params(model).items()}
    n_params = sum(p.numel() for p in model.parameters())
    prox = fedprox_term(model, global_params, mu=0.2)
    # ||theta - theta_g||^2 = 1 per entry
    assert float(prox().detach()) == pytest.approx(0.5 * 0.2 * n_params)
    with pytest.raises(KeyError, match="lacks 1 trainable parameter"):
        fedprox_term(model, {k: v for k, v in global_params.items() if k != "fc.bias"}, mu=0.1)

    data = separable(n=32)
    start = get_params(fresh())

    def distance(mu: float) -> float:
        m = fresh()
        train_local(
            m,
            data,
            TrainConfig(epochs=4, batch_size=8, lr=0.05, optimizer="sgd", fedprox_mu=mu),
            global_params=start,
        )
        end = get_params(m)
        return float(np.sqrt(sum(((end[k] - start[k]) ** 2).sum() for k in start)))

    plain, proximal = distance(0.0), distance(15.0)
    assert plain > 0
    assert proximal < 0.2 * plain


def test_masked_bce_ignores_nan_targets() -> None:
    logits = torch.tensor([[0.3, -1.0], [2.0, 0.5]], requires_grad=True)
    targets = torch.tensor([[1.0, float("nan")], [0.0, 1.0]])
    loss = MaskedBCEWithLogitsLoss()(logits, targets)
    known = torch.tensor([0.3, 2.0, 0.5])
    expected = F.binary_cross_entropy_with_logits(known, torch.tensor([1.0, 0.0, 1.0]))
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert logits.grad[0, 1] == 0.0
    empty = MaskedBCEWithLogitsLoss()(logits, torch.full((2, 2), float("nan")))
    assert float(empty) == 0.0
    assert isinstance(default_loss("multiclass"), nn.CrossEntropyLoss)
    with pytest.raises(ValueError, match="task must be"):
        default_loss("regression")


def test_loader_shuffle_is_seeded_and_labels_typed() -> None:
    data = separable(n=20, task="multiclass")
    order = [torch.cat([y for _, y in make_loader(data, 5, shuffle=True, seed=s)]) for s in (1, 1, 2)]
    assert torch.equal(order[0], order[1]) and not torch.equal(order[0], order[2])
    x, y = next(iter(make_loader(data, 5, shuffle=False, seed=0)))
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape == (5, 1, 16, 16)


def test_augment_batch_is_bounded_and_seeded() -> None:
    x = torch.rand(4, 1, 16, 16)
    a = augment_batch(x, torch.Generator().manual_seed(0))
    b = augment_batch(x, torch.Generator().manual_seed(0))
    assert a.shape == x.shape and torch.equal(a, b)
    assert float(a.min()) >= 0.0 and float(a.max()) <= 1.0 and not torch.equal(a, x)


def test_predict_and_evaluate() -> None:
    data = separable(n=12, task="multiclass")
    model = fresh(3).train()
    probs = predict(model, data, batch_size=5)
    assert probs.shape == (12, 3) and probs.dtype == np.float32
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)
    assert model.training  # mode restored
    out = evaluate(model, data, batch_size=5)
    logits = model.eval()(torch.as_tensor(data.images))
    assert out["loss"] == pytest.approx(
        float(F.cross_entropy(logits, torch.as_tensor(data.labels))), rel=1e-5
    )
    assert {"accuracy", "balanced_accuracy", "auc", "gm", "f1", "specificity"} <= set(out)


def test_densenet_with_batchnorm_trains_and_drops_a_singleton_last_batch() -> None:
    torch.manual_seed(0)
    model = build_model("densenet_compact", 2, img_size=16)
    res = train_local(model, separable(n=9), TrainConfig(epochs=1, batch_size=4))
    assert (res.num_steps, res.num_samples) == (2, 8)
    assert int(get_params(model)["net.features.norm0.num_batches_tracked"]) == 2


def test_get_set_params_round_trip_and_errors() -> None:
    torch.manual_seed(0)
    model = build_model("densenet_compact", 2, img_size=16)
    params = get_params(model)
    assert "net.features.norm0.running_mean" in params
    assert params["net.features.norm0.num_batches_tracked"].dtype == np.int64
    snapshot = {k: v.copy() for k, v in params.items()}
    train_local(model, separable(n=8), TrainConfig(epochs=1, batch_size=4))
    assert all(np.array_equal(params[k], snapshot[k]) for k in params)  # get_params returned copies
    assert not np.array_equal(
        get_params(model)["net.class_layers.out.weight"], params["net.class_layers.out.weight"]
    )

    averaged = dict(params)
    averaged["net.features.norm0.num_batches_tracked"] = np.array(2.6)  # floats from aggregation load
    set_params(model, averaged)
    after = get_params(model)
    assert all(np.array_equal(after[k], params[k]) for k in params if "num_batches" not in k)
    assert int(after["net.features.norm0.num_batches_tracked"]) == 3

    broken = dict(params)
    del broken["net.class_layers.out.bias"]
    broken["net.extra.weight"] = np.zeros(3)
    broken["net.class_layers.out.weight"] = np.zeros((5, 5))
    with pytest.raises(ValueError) as err:
        set_params(model, broken)
    msg = str(err.value)
    assert "missing key(s): ['net.class_layers.out.bias']" in msg
    assert "unexpected key(s): ['net.extra.weight']" in msg
    assert "net.class_layers.out.weight: got (5, 5)" in msg
    set_params(model, {"net.class_layers.out.bias": np.ones(2)}, strict=False)
    assert np.array_equal(get_params(model)["net.class_layers.out.bias"], np.ones(2, dtype=np.float32))


def test_opacus_wrapped_model_trains_through_run_epochs() -> None:
    from opacus import PrivacyEngine

    from fedweigh.train import make_optimizer, run_epochs

    data = separable(n=32)
    model = fresh()
    cfg = TrainConfig(epochs=1, batch_size=8, lr=0.05, optimizer="sgd")
    engine = PrivacyEngine(secure_mode=False)
    private, optimizer, loader = engine.make_private(
        module=model,
        optimizer=make_optimizer(model, cfg),
        data_loader=make_loader(data, cfg.batch_size, shuffle=True, seed=0),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    global_params = get_params(private)
    assert set(global_params) == set(get_params(fresh()))  # Opacus' "_module." prefix removed
    prox = fedprox_term(private, global_params, mu=0.01)
    res = run_epochs(
        private, loader, optimizer, default_loss("multilabel"), epochs=1, max_steps=None, prox=prox
    )
    assert res.num_steps == 4
    assert engine.get_epsilon(delta=1e-5) > 0
