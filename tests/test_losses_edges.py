"""The losses' edges: defaults, both sides of each bound, the messages that name the loss, the device
their class weights follow, and DAFL's per-round update against a loss built afresh."""

import re

import numpy as np
import pytest
import torch
from test_losses import mc_ctx, ml_ctx
from torch import nn

from fedweigh.losses import build_loss
from fedweigh.losses.base import LossContext
from fedweigh.losses.class_balanced import ClassBalancedLoss
from fedweigh.losses.dafl import DAFLLoss
from fedweigh.losses.focal import FocalLoss

LOGITS = torch.tensor([[0.5, -1.0, 2.0], [-0.3, 0.8, -1.5], [1.2, 0.1, 0.4]])
ML_Y = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
MC_Y = torch.tensor([0, 2, 1])


# --- device: the class weights follow the logits (a meta tensor stands in for an accelerator) ------


@pytest.mark.parametrize("name", ["pnb", "class_balanced", "dafl", "focal", "bce"])
def test_class_weights_follow_the_logits_device(name):
    """Multi-label only: the multi-class target check reads values (``.item()``), which a meta tensor lacks."""
    loss = build_loss(name, ml_ctx())
    logits = torch.zeros(2, 3, device="meta")
    assert loss(logits, torch.ones(2, 3, device="meta")).device.type == "meta"


# --- the loss's name in every refusal -------------------------------------------------------------


@pytest.mark.parametrize("name", ["focal", "class_balanced", "pnb", "dafl"])
def test_logits_of_the_wrong_width_are_refused_naming_the_loss(name):
    loss = build_loss(name, ml_ctx())
    with pytest.raises(
        ValueError, match=re.escape(f"loss '{name}' was built for 3 classes, got logits of shape (2, 4)")
    ):
        loss(torch.zeros(2, 4), torch.zeros(2, 4))


def test_focal_and_class_balanced_name_themselves_for_an_unknown_task():
    with pytest.raises(
        ValueError, match=re.escape("loss 'focal' supports task(s) ('multilabel', 'multiclass')")
    ):
        FocalLoss("regression", 3)
    with pytest.raises(ValueError, match=re.escape("loss 'class_balanced' supports task(s)")):
        ClassBalancedLoss("regression", np.array([1, 2]))


# --- focal: defaults and bounds -------------------------------------------------------------------


def test_focal_defaults_to_gamma_two_and_no_alpha():
    loss = FocalLoss("multilabel", 3)
    assert loss.gamma == 2.0 and loss.alpha is None
    torch.testing.assert_close(loss(LOGITS, ML_Y), FocalLoss("multilabel", 3, gamma=2.0)(LOGITS, ML_Y))


def test_focal_bounds_on_both_sides():
    with pytest.raises(ValueError, match=r"^focal: gamma must be >= 0, got -0\.5$"):
        FocalLoss("multilabel", 3, gamma=-0.5)
    assert FocalLoss("multilabel", 3, gamma=0.0).gamma == 0.0
    for alpha in (0.0, 1.0):  # both ends of [0, 1] are allowed
        assert FocalLoss("multilabel", 3, alpha=alpha).alpha == alpha
    for alpha in (-0.01, 1.01, 2.0):
        with pytest.raises(ValueError, match=re.escape(f"focal: alpha must lie in [0, 1], got {alpha}")):
            FocalLoss("multilabel", 3, alpha=alpha)
    with pytest.raises(
        ValueError, match=r"^focal: alpha is only defined for the multilabel \(sigmoid\) focal loss$"
    ):
        FocalLoss("multiclass", 3, alpha=0.25)


# --- class-balanced: defaults, types, refusals ----------------------------------------------------


def test_class_balanced_defaults_weigh_the_positives_only():
    counts = np.array([5, 1, 2])
    default = ClassBalancedLoss("multilabel", counts)
    assert default.weight_negatives is False and default.beta == 0.9999
    assert isinstance(default.beta, float)
    negatives_too = ClassBalancedLoss("multilabel", counts, weight_negatives=True)
    assert not torch.allclose(default(LOGITS, ML_Y), negatives_too(LOGITS, ML_Y))
    from_ctx = ClassBalancedLoss.from_context(ml_ctx(class_counts=counts, num_samples=5))
    assert from_ctx.weight_negatives is False
    torch.testing.assert_close(from_ctx(LOGITS, ML_Y), default(LOGITS, ML_Y))


def test_class_balanced_weights_do_not_depend_on_the_counts_dtype():
    as_int = ClassBalancedLoss("multilabel", np.array([5, 1, 2], dtype=np.int64), beta=0.9)
    as_float = ClassBalancedLoss("multilabel", np.array([5.0, 1.0, 2.0]), beta=0.9)
    as_f32 = ClassBalancedLoss("multilabel", np.array([5.0, 1.0, 2.0], dtype=np.float32), beta=0.9)
    torch.testing.assert_close(as_int.class_weights, as_float.class_weights, rtol=0, atol=0)
    torch.testing.assert_close(as_f32.class_weights, as_float.class_weights, rtol=0, atol=0)
    with pytest.raises(
        ValueError, match=re.escape("class_balanced: class_counts must be a vector, got shape (2, 2)")
    ):
        ClassBalancedLoss("multilabel", np.ones((2, 2)))


# --- DAFL: the per-round update is the loss built afresh -------------------------------------------


def _state(loss: DAFLLoss) -> tuple:
    return (loss.class_weights.clone(), loss.negative_weight.clone(), dict(loss.info))


@pytest.mark.parametrize("task", ["multilabel", "multiclass"])
@pytest.mark.parametrize("missing", ["half", "eps", "floor1"])
def test_dafl_update_context_equals_a_loss_built_from_the_new_context(task, missing):
    make = ml_ctx if task == "multilabel" else mc_ctx
    first = make(
        class_counts=np.array([2, 1, 1]),
        num_samples=4,
        global_class_counts=np.array([9, 3, 3]),
        global_num_samples=12,
    )
    second = make(
        class_counts=np.array([3, 1, 0]),
        num_samples=4,
        global_class_counts=np.array([8, 5, 0]),
        global_num_samples=13,
    )
    options = dict(normalize="entries", missing=missing, lam=0.3)
    loss = DAFLLoss.from_context(first, **options)
    loss.update_context(second)
    fresh = DAFLLoss.from_context(second, **options)
    weights, negative, info = _state(loss)
    torch.testing.assert_close(weights, fresh.class_weights, rtol=0, atol=0)
    torch.testing.assert_close(negative, fresh.negative_weight, rtol=0, atol=0)
    assert info.keys() == fresh.info.keys()
    for key, value in info.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(fresh.info[key]), err_msg=key)
    # and the update changed something: the first context's weights are not the second's
    assert not torch.equal(weights, DAFLLoss.from_context(first, **options).class_weights)


def test_dafl_update_context_refuses_another_task_or_width_naming_dafl():
    loss = DAFLLoss.from_context(ml_ctx())
    with pytest.raises(
        ValueError, match=re.escape("loss 'dafl' supports task(s) ('multilabel',), got 'multiclass'")
    ):
        loss.update_context(mc_ctx())
    wider = LossContext(task="multilabel", num_classes=4, class_counts=np.array([1, 1, 1, 1]), num_samples=4)
    with pytest.raises(ValueError, match="^dafl: built for 3 classes, new context has 4$"):
        loss.update_context(wider)


def test_dafl_penalty_is_l1_times_the_absolute_sum_and_zero_without_l1():
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.5, -2.0]]))
        model.bias.fill_(-0.5)
    plain = DAFLLoss.from_context(ml_ctx())
    zero = plain.penalty(model)
    assert zero.shape == () and float(zero) == 0.0
    assert DAFLLoss.from_context(ml_ctx(), l1=1.0).penalty(model).item() == pytest.approx(4.0)
    assert DAFLLoss.from_context(ml_ctx(), l1=0.25).penalty(model).item() == pytest.approx(1.0)
    # a model with nothing to train (a frozen backbone, say) has no penalty, whatever l1
    model.requires_grad_(False)
    frozen = DAFLLoss.from_context(ml_ctx(), l1=1.0).penalty(model)
    assert frozen.shape == () and frozen.item() == 0.0


# --- the loss context and the target checks: both sides of every bound --------------------------


def test_loss_context_bounds_on_both_sides():
    assert LossContext("multilabel", 1, np.array([0]), 0).num_classes == 1  # one finding, no samples: valid
    assert LossContext("multiclass", 2, np.array([1, 1]), 2).num_classes == 2
    for task, c in (("multilabel", 0), ("multiclass", 1)):
        with pytest.raises(
            ValueError,
            match=re.escape(
                f"LossContext.num_classes must be >= 1 (multilabel) or >= 2 (multiclass), got {c} for task '{task}'"
            ),
        ):
            LossContext(task, c, np.zeros(c), 4)
    with pytest.raises(
        ValueError,
        match=re.escape("LossContext.task must be one of ('multilabel', 'multiclass'), got 'ranking'"),
    ):
        LossContext("ranking", 3, np.zeros(3), 4)
    with pytest.raises(ValueError, match=re.escape("LossContext.num_samples must be non-negative, got -1")):
        LossContext("multilabel", 2, np.zeros(2), -1)
    with pytest.raises(
        ValueError, match=re.escape("LossContext.class_counts must be non-negative, got [-1.0, 0.0]")
    ):
        LossContext("multilabel", 2, np.array([-1, 0]), 4)
    assert LossContext("multilabel", 2, np.array([4, 0]), 4).class_counts.tolist() == [4.0, 0.0]  # = N: valid
    with pytest.raises(
        ValueError, match=re.escape("LossContext.class_counts [5.0, 0.0] exceed num_samples=4")
    ):
        LossContext("multilabel", 2, np.array([5, 0]), 4)
    with pytest.raises(
        ValueError, match=re.escape("LossContext.class_counts must have shape (2,), got (3,)")
    ):
        LossContext("multilabel", 2, np.zeros(3), 4)
    with pytest.raises(
        ValueError, match=re.escape("LossContext.global_class_counts holds non-finite values: [1.0, nan]")
    ):
        LossContext("multilabel", 2, np.zeros(2), 4, global_class_counts=np.array([1.0, np.nan]))
    assert LossContext("multilabel", 2, np.zeros(2), 4, global_num_samples=1).global_num_samples == 1
    with pytest.raises(ValueError, match=re.escape("LossContext.global_num_samples must be positive, got 0")):
        LossContext("multilabel", 2, np.zeros(2), 4, global_num_samples=0)
    assert (
        LossContext("multilabel", 2, np.zeros(2), 4, client_level_parameter=0.0).client_level_parameter == 0.0
    )
    with pytest.raises(
        ValueError, match=re.escape("LossContext.client_level_parameter must be finite, got inf")
    ):
        LossContext("multilabel", 2, np.zeros(2), 4, client_level_parameter=float("inf"))


def test_multiclass_targets_bounds_on_both_sides():
    from fedweigh.losses.base import multiclass_targets, multilabel_targets

    logits = torch.zeros(3, 4)
    assert multiclass_targets(logits, torch.tensor([0, 3, 1])).tolist() == [0, 3, 1]
    assert multiclass_targets(logits, torch.tensor([[0.0], [2.6], [1.2]])).tolist() == [
        0,
        3,
        1,
    ]  # (B, 1), rounded
    for given in (torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0.0, 1.0, 2.4])):
        assert multiclass_targets(logits, given).dtype == torch.int64
    # checked where they are, then moved to the logits' device (a meta tensor stands in for an accelerator)
    moved = multiclass_targets(torch.zeros(3, 4, device="meta"), torch.tensor([0, 3, 1]))
    assert moved.device.type == "meta" and moved.dtype == torch.int64
    for bad, low, high in (([0, 4, 1], 0, 4), ([-1, 0, 1], -1, 1)):
        with pytest.raises(
            ValueError, match=re.escape(f"multiclass targets must lie in [0, 4), got min {low}, max {high}")
        ):
            multiclass_targets(logits, torch.tensor(bad))
    with pytest.raises(ValueError, match="^multiclass targets contain NaN: class indices are required$"):
        multiclass_targets(logits, torch.tensor([0.0, float("nan"), 1.0]))
    with pytest.raises(ValueError, match=re.escape("multiclass targets must have shape (3,), got (2,)")):
        multiclass_targets(logits, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=re.escape("multiclass logits must have shape (B, C), got (4,)")):
        multiclass_targets(torch.zeros(4), torch.tensor([0]))
    assert multiclass_targets(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long)).numel() == 0
    y, valid = multilabel_targets(logits, torch.tensor([[1.0, float("nan"), 0.0, 1.0]] * 3))
    assert y[0].tolist() == [1.0, 0.0, 0.0, 1.0] and valid[0].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert y.dtype == torch.float32 and valid.dtype == torch.float32
    with pytest.raises(
        ValueError, match=re.escape("multilabel targets must have the logits' shape (3, 4), got (3, 3)")
    ):
        multilabel_targets(logits, torch.zeros(3, 3))
    with pytest.raises(
        ValueError, match=re.escape("multilabel logits must have shape (B, C), got (3, 4, 1)")
    ):
        multilabel_targets(torch.zeros(3, 4, 1), torch.zeros(3, 4, 1))


def test_the_default_penalty_is_a_zero_on_the_models_device():
    from fedweigh.losses.bce import BCELoss

    loss = BCELoss()
    on_meta = loss.penalty(nn.Linear(2, 1, device="meta"))
    assert on_meta.device.type == "meta" and on_meta.shape == ()
    no_parameters = loss.penalty(nn.Identity())  # a model without parameters: a zero on the default device
    assert no_parameters.device.type == "cpu" and no_parameters.item() == 0.0
