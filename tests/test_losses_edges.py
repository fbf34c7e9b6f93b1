"""The losses' edges: defaults, both sides of each bound, the messages that name the loss, the device
their class weights follow, and DAFL's per-round update against a loss built afresh."""

import re

import numpy as np
import pytest
import torch
from test_losses import hand_alphas, mc_ctx, ml_ctx
from torch import nn

from fedweigh.imbalance import client_imbalance
from fedweigh.losses import build_loss
from fedweigh.losses.base import LossContext
from fedweigh.losses.class_balanced import ClassBalancedLoss
from fedweigh.losses.dafl import DAFLLoss, dafl_coefficients, dafl_loss_weights, local_prevalence
from fedweigh.losses.focal import FocalLoss
from fedweigh.losses.pnb import PNBLoss, pnb_negative_counts

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


# --- PNB: defaults, the count divisor on every path, mu's bound on both sides, the negatives readings --


def test_pnb_alphas_default_divisor_is_one_and_alphas_are_float64_for_any_count_dtype():
    from fedweigh.losses.pnb import pnb_alphas

    pos, neg = [2, 5, 1], [6, 3, 7]
    expected = hand_alphas(pos, neg, 0.9)
    assert hand_alphas(pos, neg, 0.9, a=2.0)[0] != pytest.approx(expected[0], rel=1e-3)  # a matters here
    for dtype in (np.int64, np.int32, np.float32, np.float64):
        ap, an = pnb_alphas(np.array(pos, dtype=dtype), np.array(neg, dtype=dtype), 0.9)
        assert ap.dtype == np.float64 and an.dtype == np.float64, dtype
        assert ap.tolist() == pytest.approx(expected[0], rel=1e-12), dtype
        assert an.tolist() == pytest.approx(expected[1], rel=1e-12), dtype


def test_pnb_loss_defaults_are_the_papers_mu_4_beta_0_9999_a_1_text_negatives():
    ctx = ml_ctx(class_counts=np.array([2, 5, 1]), num_samples=8)
    for loss in (PNBLoss("multilabel", np.array([2, 5, 1]), np.array([6, 3, 7])), PNBLoss.from_context(ctx)):
        assert (loss.mu, loss.beta, loss.a) == (4.0, 0.9999, 1.0)
        assert loss.alpha_pos.tolist() == pytest.approx(
            hand_alphas([2, 5, 1], [6, 3, 7], 0.9999)[0], rel=1e-6
        )
    assert pnb_negative_counts(ctx).tolist() == [6.0, 3.0, 7.0]  # "text": N_k - n+_j


def test_pnb_count_divisor_reaches_the_alphas_by_both_constructors():
    pos, neg = [2, 5, 1], [6, 3, 7]
    expected = hand_alphas(pos, neg, 0.9, a=3.0)
    direct = PNBLoss("multilabel", np.array(pos), np.array(neg), beta=0.9, a=3.0)
    built = PNBLoss.from_context(ml_ctx(class_counts=np.array(pos), num_samples=8), beta=0.9, a=3.0)
    for loss in (direct, built):
        assert (loss.beta, loss.a) == (0.9, 3.0)
        assert isinstance(loss.beta, float) and isinstance(loss.a, float)
        assert loss.alpha_pos.tolist() == pytest.approx(expected[0], rel=1e-6)
        assert loss.alpha_neg.tolist() == pytest.approx(expected[1], rel=1e-6)


def test_pnb_mu_must_be_positive_and_any_positive_mu_scales_the_loss():
    pos, neg = np.array([2, 5, 1]), np.array([6, 3, 7])
    for mu in (0.0, -1.0):
        with pytest.raises(ValueError, match=re.escape(f"pnb: mu must be positive, got {mu}")):
            PNBLoss("multilabel", pos, neg, mu=mu)
    four = PNBLoss("multilabel", pos, neg, mu=4.0, beta=0.9)(LOGITS, ML_Y).item()
    for mu in (0.5, 1.0, 1e-3):
        got = PNBLoss("multilabel", pos, neg, mu=mu, beta=0.9)(LOGITS, ML_Y).item()
        assert got == pytest.approx(four * mu / 4.0, rel=1e-6)


def test_pnb_names_itself_for_an_unknown_task():
    with pytest.raises(ValueError) as refused:
        PNBLoss("regression", np.array([1, 2]), np.array([2, 1]))
    assert str(refused.value) == "loss 'pnb' supports task(s) ('multilabel', 'multiclass'), got 'regression'"


def test_pnb_code_and_global_negatives_are_zero_where_nothing_is_left():
    """ "code": a class holding every positive has 0 negatives; "global": a class absent everywhere and a
    class held by this client alone have 0 negatives (not 1)."""
    ctx = ml_ctx(class_counts=np.array([3, 0, 0]), num_samples=3)
    assert pnb_negative_counts(ctx, "code").tolist() == [0.0, 3.0, 3.0]
    glob = mc_ctx(
        class_counts=np.array([3, 0, 1]), global_class_counts=np.array([3, 0, 4]), global_num_samples=7
    )
    assert pnb_negative_counts(glob, "global").tolist() == [0.0, 0.0, 3.0]


def test_pnb_global_negatives_refusals_are_whole_sentences():
    with pytest.raises(ValueError) as refused:
        pnb_negative_counts(ml_ctx(global_class_counts=np.array([3, 3, 3]), global_num_samples=9), "global")
    assert (
        str(refused.value) == "pnb: negatives='global' is defined for multiclass only (use 'text' or 'code')"
    )
    with pytest.raises(ValueError) as refused:
        pnb_negative_counts(mc_ctx(), "global")
    assert str(refused.value) == (
        "pnb: negatives='global' needs LossContext.global_class_counts (the securely aggregated histogram)"
    )


# --- DAFL: each bound on both sides, each refusal as a sentence, the weights' normalisations -------

# a multilabel site with 4 images: positives (2, 1, 1) -> c_class (1, 3, 3) on its own histogram,
# c_k = 7/3 (no missing class)
SITE = dict(task="multilabel", num_classes=3, class_counts=np.array([2, 1, 1]), num_samples=4)


@pytest.mark.parametrize("lam", [-0.01, 1.01, -1.0, 2.0])
def test_dafl_lam_outside_zero_one_is_refused(lam):
    with pytest.raises(ValueError) as refused:
        dafl_coefficients(LossContext(**SITE), lam=lam)
    assert str(refused.value) == f"dafl: lam must lie in [0, 1], got {lam}"


def test_dafl_lam_at_each_end_is_the_pure_class_or_client_term():
    ctx = LossContext(**SITE)
    assert dafl_coefficients(ctx, lam=0.0)[0].tolist() == pytest.approx([1.0, 3.0, 3.0])
    assert dafl_coefficients(ctx, lam=1.0)[0].tolist() == pytest.approx([7 / 3] * 3)
    assert dafl_coefficients(ctx)[0].tolist() == pytest.approx(
        [(7 / 3 + 1) / 2, (7 / 3 + 3) / 2, (7 / 3 + 3) / 2]
    )


def test_dafl_coefficients_name_their_sources_and_use_the_federations_statistics_when_given():
    local, info = dafl_coefficients(LossContext(**SITE), client_term="global")
    assert info["c_client_source"] == "local" and info["c_class_source"] == "local"
    assert info["c_client"] == pytest.approx(7 / 3) and info["c_class"].tolist() == pytest.approx([1, 3, 3])
    ctx = LossContext(
        **SITE, global_class_counts=np.array([5, 0, 2]), global_num_samples=10, client_level_parameter=4.0
    )
    c, info = dafl_coefficients(ctx, lam=0.5, client_term="global")
    assert (info["c_client_source"], info["c_class_source"]) == ("global", "global")
    assert info["c_client"] == 4.0
    assert info["c_class"].tolist() == pytest.approx(
        [1.0, 0.0, 4.0]
    )  # (10 - 5) / 5, nobody holds it, (10 - 2) / 2
    assert c.tolist() == pytest.approx([2.5, 2.0, 4.0])
    own, info = dafl_coefficients(
        ctx, lam=0.5, client_term="local"
    )  # the site's c_k, the federation's c_class
    assert info["c_client_source"] == "local" and own.tolist() == pytest.approx(
        [(7 / 3 + 1) / 2, 7 / 6, (7 / 3 + 4) / 2]
    )


def test_dafl_coefficients_clip_at_zero_and_need_the_global_size_with_the_global_histogram():
    """A noised c_client below zero cannot make a class weigh less than 1 (c is clipped at 0)."""
    ctx = LossContext(**SITE, client_level_parameter=-10.0)
    assert dafl_coefficients(ctx, lam=1.0, client_term="global")[0].tolist() == [0.0, 0.0, 0.0]
    assert dafl_coefficients(ctx, lam=0.5, client_term="global")[0].tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError) as refused:
        dafl_coefficients(LossContext(**SITE, global_class_counts=np.array([5, 1, 2])))
    assert (
        str(refused.value) == "dafl: LossContext.global_class_counts is set but global_num_samples is missing"
    )


def test_dafl_unknown_client_term_is_refused_by_the_coefficients_and_the_loss():
    expected = "dafl: client_term must be one of ('local', 'global'), got 'site'"
    with pytest.raises(ValueError) as refused:
        dafl_coefficients(LossContext(**SITE), client_term="site")
    assert str(refused.value) == expected
    with pytest.raises(ValueError) as refused:
        DAFLLoss("multiclass", np.zeros(3), client_term="site")
    assert str(refused.value) == expected


def test_dafl_loss_weights_under_each_normalisation():
    c = np.array([1.0, 3.0, 0.0])  # w = (2, 4, 1)
    pos, neg = dafl_loss_weights(c, "none", "multilabel")
    assert pos.tolist() == [2.0, 4.0, 1.0] and neg == 1.0
    pos, neg = dafl_loss_weights(c, "mean", "multilabel")
    assert pos.tolist() == pytest.approx([6 / 7, 12 / 7, 3 / 7]) and neg == 1.0
    q = np.array([0.5, 0.25, 1.0])
    scale = np.mean([0.5 * 2 + 0.5, 0.25 * 4 + 0.75, 1.0 * 1 + 0.0])  # mean of q w + (1 - q)
    pos, neg = dafl_loss_weights(c, "entries", "multilabel", q)
    assert pos.tolist() == pytest.approx([2 / scale, 4 / scale, 1 / scale]) and neg == pytest.approx(
        1 / scale
    )
    pos, neg = dafl_loss_weights(c, "entries", "multiclass", np.array([0.5, 0.25, 0.25]))
    scale = 0.5 * 2 + 0.25 * 4 + 0.25 * 1  # sum of q w
    assert pos.tolist() == pytest.approx([2 / scale, 4 / scale, 1 / scale]) and neg == pytest.approx(
        1 / scale
    )


def test_dafl_entries_weights_clip_the_prevalence_and_leave_an_empty_site_unscaled():
    c = np.array([1.0, 3.0, 0.0])
    clipped = dafl_loss_weights(c, "entries", "multilabel", np.array([1.5, -0.5, 0.25]))
    assert (
        clipped[0].tolist()
        == dafl_loss_weights(c, "entries", "multilabel", np.array([1.0, 0.0, 0.25]))[0].tolist()
    )
    pos, neg = dafl_loss_weights(c, "entries", "multiclass", np.zeros(3))  # sum q w = 0: nothing to normalise
    assert pos.tolist() == [2.0, 4.0, 1.0] and neg == 1.0


def test_dafl_loss_weights_refusals():
    with pytest.raises(ValueError) as refused:
        dafl_loss_weights(np.zeros(3), "auto", "multilabel")
    assert str(refused.value) == "dafl: normalize must be one of ('entries', 'mean', 'none') here, got 'auto'"
    with pytest.raises(ValueError) as refused:
        dafl_loss_weights(np.zeros(3), "entries", "multilabel")
    assert str(refused.value) == "dafl: normalize='entries' needs the site's class prevalence"


def test_dafl_local_prevalence_is_float64_and_zero_for_an_empty_site():
    q = local_prevalence(LossContext(**SITE))
    assert q.dtype == np.float64 and q.tolist() == [0.5, 0.25, 0.25]
    empty = local_prevalence(
        LossContext(task="multilabel", num_classes=3, class_counts=np.zeros(3), num_samples=0)
    )
    assert empty.tolist() == [0.0, 0.0, 0.0]


def test_dafl_loss_defaults_and_the_papers_gamma():
    loss = DAFLLoss("multiclass", np.array([1.0, 3.0, 0.0]))
    assert (loss.gamma, loss.normalize, loss.l1, loss.lam, loss.client_term, loss.missing) == (
        2.0,
        "none",
        0.0,
        0.5,
        "local",
        "half",
    )
    assert loss.class_weights.tolist() == [2.0, 4.0, 1.0] and loss.negative_weight.item() == 1.0
    built = DAFLLoss.from_context(LossContext(**SITE))
    assert (built.gamma, built.normalize, built.l1, built.lam, built.client_term, built.missing) == (
        2.0,
        "entries",
        0.0,
        0.5,
        "local",
        "half",
    )
    expected_c, _ = dafl_coefficients(LossContext(**SITE), 0.5, "local", "half")
    expected, _ = dafl_loss_weights(expected_c, "entries", "multilabel", np.array([0.5, 0.25, 0.25]))
    assert built.class_weights.tolist() == pytest.approx(expected.tolist(), rel=1e-6)


def test_dafl_from_context_passes_every_option_to_the_loss():
    ctx = LossContext(**SITE, client_level_parameter=5.0)
    loss = DAFLLoss.from_context(
        ctx,
        lam=0.25,
        gamma=1.5,
        normalize="mean",
        learnable_gamma=True,
        l1=1e-3,
        client_term="global",
        missing="eps",
    )
    assert isinstance(loss.gamma, nn.Parameter) and loss.gamma.item() == 1.5
    assert (loss.normalize, loss.l1, loss.lam, loss.client_term, loss.missing) == (
        "mean",
        1e-3,
        0.25,
        "global",
        "eps",
    )
    c = np.maximum(0.25 * 5.0 + 0.75 * np.array([1.0, 3.0, 3.0]), 0.0)
    assert loss.class_weights.tolist() == pytest.approx(((1 + c) / (1 + c).mean()).tolist(), rel=1e-6)
    assert loss.info["c_client_source"] == "global"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            dict(normalize="sum"),
            "dafl: normalize must be one of ('auto', 'entries', 'mean', 'none'), got 'sum'",
        ),
        (dict(gamma=-0.5), "dafl: gamma must be >= 0, got -0.5"),
        (dict(l1=-1e-6), "dafl: l1 must be >= 0, got -1e-06"),
        (
            dict(normalize="entries"),
            "dafl: normalize='entries' needs prevalence (the site's n_j / N_k); use from_context",
        ),
    ],
)
def test_dafl_loss_refusals_are_whole_sentences(options, message):
    with pytest.raises(ValueError) as refused:
        DAFLLoss("multiclass", np.zeros(3), **options)
    assert str(refused.value) == message


def test_dafl_loss_accepts_gamma_and_l1_at_zero():
    loss = DAFLLoss("multiclass", np.zeros(3), gamma=0.0, l1=0.0)
    assert (loss.gamma, loss.l1) == (0.0, 0.0)


@pytest.mark.parametrize("c", [np.array([1.0, np.nan, 0.0]), np.array([1.0, np.inf, 0.0]), np.zeros((2, 3))])
def test_dafl_loss_refuses_coefficients_that_are_not_a_finite_vector(c):
    with pytest.raises(ValueError) as refused:
        DAFLLoss("multiclass", c)
    assert str(refused.value) == f"dafl: c must be a finite vector, got {c.tolist()}"


def test_dafl_learnable_gamma_below_zero_acts_as_zero():
    c = np.array([1.0, 3.0, 0.0])
    learnable = DAFLLoss("multiclass", c, learnable_gamma=True)
    with torch.no_grad():
        learnable.gamma.fill_(-1.0)
    plain = DAFLLoss("multiclass", c, gamma=0.0)
    assert learnable(LOGITS, MC_Y).item() == pytest.approx(plain(LOGITS, MC_Y).item(), rel=1e-6)


def test_dafl_logs_which_statistics_it_fell_back_to(caplog):
    with caplog.at_level("INFO", logger="fedweigh.losses.dafl"):
        DAFLLoss.from_context(LossContext(**SITE), client_term="global")
    assert "dafl: c_client from local statistics, c_class from local statistics" in caplog.text
    caplog.clear()
    full = LossContext(
        **SITE, global_class_counts=np.array([5, 1, 2]), global_num_samples=10, client_level_parameter=2.0
    )
    with caplog.at_level("INFO", logger="fedweigh.losses.dafl"):
        DAFLLoss.from_context(full, client_term="global")
        DAFLLoss.from_context(full, client_term="local")
    assert "dafl:" not in caplog.text
    with caplog.at_level("INFO", logger="fedweigh.losses.dafl"):
        DAFLLoss.from_context(LossContext(**SITE, client_level_parameter=2.0), client_term="global")
    assert "dafl: c_client from global statistics, c_class from local statistics" in caplog.text


def test_dafl_local_client_term_follows_the_missing_rule():
    """A site missing a class: c_k depends on the ``missing`` rule, and the loss's local term uses it."""
    ctx = LossContext(task="multilabel", num_classes=3, class_counts=np.array([2, 0, 1]), num_samples=4)
    for rule in ("half", "eps", "floor1"):
        _, info = dafl_coefficients(ctx, missing=rule)
        assert info["c_client"] == client_imbalance(np.array([2, 0, 1]), 4, rule), rule
    assert (
        dafl_coefficients(ctx, missing="eps")[1]["c_client"]
        != dafl_coefficients(ctx, missing="half")[1]["c_client"]
    )


def test_dafl_loss_weights_are_float64_for_float32_inputs():
    c32, q32 = np.array([0.1, 0.3, 0.7], dtype=np.float32), np.array([0.1, 0.3, 0.7], dtype=np.float32)
    c64, q64 = c32.astype(np.float64), q32.astype(np.float64)
    for normalize in ("none", "mean", "entries"):
        pos, neg = dafl_loss_weights(c32, normalize, "multilabel", q32)
        want, want_neg = dafl_loss_weights(c64, normalize, "multilabel", q64)
        assert pos.dtype == np.float64 and pos.tolist() == want.tolist() and neg == want_neg, normalize


def test_dafl_entries_scale_below_one_still_divides():
    """Any positive scale divides (here sum_c q_c w_c = 0.25 for a multi-class site whose prevalences
    sum to 0.25); only 0 or a non-finite scale leaves the weights as they are."""
    pos, neg = dafl_loss_weights(np.zeros(3), "entries", "multiclass", np.array([0.25, 0.0, 0.0]))
    assert pos.tolist() == [4.0, 4.0, 4.0] and neg == 4.0


def test_dafl_local_prevalence_of_a_one_image_site():
    ctx = LossContext(task="multilabel", num_classes=3, class_counts=np.array([1, 0, 1]), num_samples=1)
    assert local_prevalence(ctx).tolist() == [1.0, 0.0, 1.0]


def test_dafl_names_itself_for_an_unknown_task_and_starts_with_a_fixed_gamma_and_no_info():
    with pytest.raises(ValueError) as refused:
        DAFLLoss("regression", np.zeros(3))
    assert str(refused.value) == "loss 'dafl' supports task(s) ('multilabel', 'multiclass'), got 'regression'"
    loss = DAFLLoss("multiclass", np.zeros(3))
    assert type(loss.gamma) is float and loss.info == {} and list(loss.parameters()) == []
    built = DAFLLoss.from_context(LossContext(**SITE))
    assert type(built.gamma) is float and list(built.parameters()) == []


def _dafl_log(caplog, ctx, client_term):
    caplog.clear()
    with caplog.at_level("INFO", logger="fedweigh.losses.dafl"):
        DAFLLoss.from_context(ctx, client_term=client_term)
    return [r.getMessage() for r in caplog.records if r.name == "fedweigh.losses.dafl"]


def test_dafl_logs_a_fallback_of_either_statistic_alone_in_its_exact_words(caplog):
    global_class = LossContext(**SITE, global_class_counts=np.array([5, 1, 2]), global_num_samples=10)
    assert _dafl_log(caplog, global_class, "global") == [
        "dafl: c_client from local statistics, c_class from global statistics"
    ]
    assert _dafl_log(caplog, global_class, "local") == []
    assert _dafl_log(caplog, LossContext(**SITE), "local") == [
        "dafl: c_client from local statistics, c_class from local statistics"
    ]


# --- the losses' shared helpers -----------------------------------------------------------------


def test_masked_mean_of_a_single_valid_entry_is_that_entry():
    from fedweigh.losses.base import masked_mean

    values = torch.tensor([[3.0, 5.0], [7.0, 11.0]])
    assert masked_mean(values, torch.tensor([[0.0, 1.0], [0.0, 0.0]])).item() == 5.0
    assert masked_mean(values, torch.zeros(2, 2)).item() == 0.0


def test_multilabel_targets_follow_the_logits_device_and_are_float32():
    from fedweigh.losses.base import multilabel_targets

    for targets in (torch.tensor([[1.0, 0.0]], dtype=torch.float64), torch.tensor([[1, 0]])):
        y, valid = multilabel_targets(torch.zeros(1, 2), targets)
        assert y.dtype == torch.float32 and valid.dtype == torch.float32
    y, valid = multilabel_targets(torch.zeros(1, 2, device="meta"), torch.tensor([[1.0, float("nan")]]))
    assert y.device.type == "meta" and valid.device.type == "meta"


def test_weights_buffer_is_float32():
    from fedweigh.losses.base import weights_buffer

    for values in (np.array([0.25, 0.5]), [0.25, 0.5], np.array([1, 2])):
        assert weights_buffer(values).dtype == torch.float32


def test_an_unknown_loss_is_refused_listing_every_name():
    from fedweigh.losses import LOSSES

    with pytest.raises(KeyError) as refused:
        build_loss("dice", ml_ctx())
    assert refused.value.args[0] == f"unknown loss 'dice'; known losses: {', '.join(sorted(LOSSES))}, default"
