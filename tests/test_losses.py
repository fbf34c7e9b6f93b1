"""Client losses: hand-computed values on tiny batches, invariants, masking, gradients, registry."""

from __future__ import annotations

import math
import re
import warnings
from decimal import Decimal, getcontext

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedweigh.losses import (
    LOSSES,
    ClassBalancedLoss,
    DAFLLoss,
    FocalLoss,
    LossContext,
    PNBLoss,
    build_loss,
    inverse_effective_number,
)

torch.set_num_threads(1)
NAN = float("nan")


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def softmax(row: list[float]) -> list[float]:
    e = [math.exp(v) for v in row]
    return [v / sum(e) for v in e]


def bce_terms(x: float) -> tuple[float, float]:
    """(-log s, -log(1 - s)) for logit x."""
    return -math.log(sig(x)), -math.log(1.0 - sig(x))


def inv_eff(n: float, beta: float) -> float:
    return (1.0 - beta) / (1.0 - beta**n)


ML_LOGITS = [[0.5, -1.0, 2.0], [-0.3, 0.8, -1.5], [1.2, 0.1, 0.4]]
ML_TARGETS = [[1.0, 0.0, NAN], [0.0, 1.0, 1.0], [1.0, NAN, 0.0]]
MC_LOGITS = [[1.0, 0.0, -1.0], [0.2, 0.4, 0.1], [-0.5, 1.5, 0.3]]
MC_TARGETS = [0, 2, 1]


def ml_ctx(**kw) -> LossContext:
    base = dict(task="multilabel", num_classes=3, class_counts=np.array([2, 1, 0]), num_samples=4)
    base.update(kw)
    return LossContext(**base)


def mc_ctx(**kw) -> LossContext:
    base = dict(task="multiclass", num_classes=3, class_counts=np.array([3, 1, 0]), num_samples=4)
    base.update(kw)
    return LossContext(**base)


def t(values, dtype=torch.float32, grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, requires_grad=grad)


# ---------------------------------------------------------------- BCE / CE


def test_bce_masks_nan_and_matches_hand_value() -> None:
    terms = []
    for row_x, row_y in zip(ML_LOGITS, ML_TARGETS, strict=True):
        for x, y in zip(row_x, row_y, strict=True):
            if not math.isnan(y):
                lp, ln = bce_terms(x)
                terms.append(y * lp + (1 - y) * ln)
    expected = sum(terms) / len(terms)
    got = build_loss("bce", ml_ctx())(t(ML_LOGITS), t(ML_TARGETS))
    assert len(terms) == 7
    assert got.item() == pytest.approx(expected, rel=1e-6)


def test_ce_matches_hand_value() -> None:
    expected = np.mean([-math.log(softmax(z)[y]) for z, y in zip(MC_LOGITS, MC_TARGETS, strict=True)])
    got = build_loss("ce", mc_ctx())(t(MC_LOGITS), torch.tensor(MC_TARGETS))
    assert got.item() == pytest.approx(expected, rel=1e-6)


def test_default_resolves_by_task() -> None:
    assert type(build_loss("default", ml_ctx())).__name__ == "BCELoss"
    assert type(build_loss("default", mc_ctx())).__name__ == "CELoss"


# ---------------------------------------------------------------- focal


def test_focal_gamma_zero_equals_bce_and_ce() -> None:
    z = t(ML_LOGITS)
    y = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    focal = build_loss("focal", ml_ctx(), gamma=0.0)(z, y)
    assert focal.item() == pytest.approx(F.binary_cross_entropy_with_logits(z, y).item(), rel=1e-6)
    zc, yc = t(MC_LOGITS), torch.tensor(MC_TARGETS)
    focal_mc = build_loss("focal", mc_ctx(), gamma=0.0)(zc, yc)
    assert focal_mc.item() == pytest.approx(F.cross_entropy(zc, yc).item(), rel=1e-6)


@pytest.mark.parametrize("alpha", [None, 0.25])
def test_sigmoid_focal_hand_value(alpha: float | None) -> None:
    a_pos, a_neg = (1.0, 1.0) if alpha is None else (alpha, 1 - alpha)
    terms = []
    for row_x, row_y in zip(ML_LOGITS, ML_TARGETS, strict=True):
        for x, y in zip(row_x, row_y, strict=True):
            if math.isnan(y):
                continue
            s = sig(x)
            terms.append(a_pos * y * (1 - s) ** 2 * -math.log(s) + a_neg * (1 - y) * s**2 * -math.log(1 - s))
    got = build_loss("focal", ml_ctx(), gamma=2.0, alpha=alpha)(t(ML_LOGITS), t(ML_TARGETS))
    assert got.item() == pytest.approx(sum(terms) / len(terms), rel=1e-6)


def test_softmax_focal_hand_value() -> None:
    terms = []
    for z, y in zip(MC_LOGITS, MC_TARGETS, strict=True):
        p = softmax(z)[y]
        terms.append(-((1 - p) ** 2) * math.log(p))
    got = build_loss("focal", mc_ctx())(t(MC_LOGITS), torch.tensor(MC_TARGETS))
    assert got.item() == pytest.approx(np.mean(terms), rel=1e-6)


def test_focal_rejects_multiclass_alpha() -> None:
    with pytest.raises(ValueError, match="alpha"):
        FocalLoss("multiclass", 3, alpha=0.25)


# ---------------------------------------------------------------- effective number / class-balanced


@pytest.mark.parametrize("beta", [0.9999, 0.9999999])
@pytest.mark.parametrize("n", [1.0, 7.0, 2500.0, 86336.0])
def test_inverse_effective_number_is_precise_near_one(beta: float, n: float) -> None:
    getcontext().prec = 50
    b = Decimal(beta)  # the exact binary value of beta
    exact = (1 - b) / (1 - b ** Decimal(n))
    got = inverse_effective_number(np.array([n]), beta)[0]
    assert got == pytest.approx(float(exact), rel=1e-12)


def test_inverse_effective_number_limits_and_zero() -> None:
    got = inverse_effective_number(np.array([0.0, 4.0, 20.0]), 1.0, a=2.0)
    assert np.isinf(got[0])
    assert got[1:] == pytest.approx([0.5, 0.1])  # beta = 1: a / n
    assert inverse_effective_number(np.array([3.0]), 0.0)[0] == 1.0


@pytest.mark.parametrize("beta", [-0.01, 1.5])
def test_inverse_effective_number_refuses_a_beta_outside_zero_one_on_both_sides(beta: float) -> None:
    with pytest.raises(ValueError, match=re.escape(f"beta must lie in [0, 1], got {beta}")):
        inverse_effective_number(np.array([3.0]), beta)


@pytest.mark.parametrize("a", [0.0, -2.0])
def test_inverse_effective_number_refuses_a_divisor_that_is_not_positive(a: float) -> None:
    with pytest.raises(ValueError, match=re.escape(f"the count divisor a must be positive, got {a}")):
        inverse_effective_number(np.array([3.0]), 0.9, a=a)


@pytest.mark.parametrize(
    "counts", [[1.0, -2.0], [1.0, float("inf")], [float("nan"), 2.0]], ids=["negative", "inf", "nan"]
)
def test_inverse_effective_number_refuses_each_kind_of_bad_count_alone(counts: list[float]) -> None:
    # one defect per case: a check that needs two defects at once (``and`` for ``or``) lets each through
    with pytest.raises(ValueError, match=re.escape(f"counts must be finite and non-negative, got {counts}")):
        inverse_effective_number(np.array(counts), 0.9)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_inverse_effective_number_is_inf_exactly_where_the_count_is_zero(beta: float) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no division by zero, no log of 0, at any beta
        got = inverse_effective_number(np.array([0.0, 3.0, 0.0, 1.0]), beta)
    assert np.isinf(got[[0, 2]]).all()
    assert np.isfinite(got[[1, 3]]).all()
    if beta == 0.0:
        assert got[[1, 3]].tolist() == [1.0, 1.0]  # beta = 0: no reweighting


def test_inverse_effective_number_divides_in_float64_whatever_the_counts_dtype() -> None:
    # float32 counts divided by a = 3 in float32 lose ~1e-8 relative: the docstring promises float64
    counts = [7, 2500, 86336]
    want = inverse_effective_number(np.array(counts, dtype=np.float64), 0.9999999, a=3.0)
    for dtype in (np.float32, np.int64):
        got = inverse_effective_number(np.array(counts, dtype=dtype), 0.9999999, a=3.0)
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=0)


def test_class_balanced_weights_multiclass_hand_value() -> None:
    beta = 0.5
    raw = [inv_eff(3, beta), inv_eff(1, beta), 0.0]  # class 2 has no samples
    w = [3 * r / sum(raw) for r in raw]
    loss = build_loss("class_balanced", mc_ctx(), beta=beta)
    assert loss.class_weights.tolist() == pytest.approx(w, rel=1e-6)
    assert loss.class_weights[2].item() == 0.0
    assert loss.class_weights.sum().item() == pytest.approx(3.0)
    expected = np.mean([w[y] * -math.log(softmax(z)[y]) for z, y in zip(MC_LOGITS, MC_TARGETS, strict=True)])
    got = loss(t(MC_LOGITS), torch.tensor(MC_TARGETS))
    assert math.isfinite(got.item())
    assert got.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("weight_negatives", [False, True])
def test_class_balanced_multilabel_hand_value(weight_negatives: bool) -> None:
    beta = 0.5
    raw = [inv_eff(2, beta), inv_eff(1, beta), 0.0]
    w = [3 * r / sum(raw) for r in raw]
    terms = []
    for row_x, row_y in zip(ML_LOGITS, ML_TARGETS, strict=True):
        for j, (x, y) in enumerate(zip(row_x, row_y, strict=True)):
            if math.isnan(y):
                continue
            lp, ln = bce_terms(x)
            v = w[j] if weight_negatives else 1.0
            terms.append(w[j] * y * lp + v * (1 - y) * ln)
    loss = build_loss("class_balanced", ml_ctx(), beta=beta, weight_negatives=weight_negatives)
    got = loss(t(ML_LOGITS), t(ML_TARGETS))
    assert got.item() == pytest.approx(sum(terms) / len(terms), rel=1e-6)


# ---------------------------------------------------------------- PNB


def hand_alphas(pos: list[float], neg: list[float], beta: float, a: float = 1.0) -> tuple[list, list]:
    ap, an = [], []
    for p, n in zip(pos, neg, strict=True):
        if p == 0 or n == 0:
            ap.append(0.0)
            an.append(0.0)
            continue
        ep, en = inv_eff(p / a, beta), inv_eff(n / a, beta)
        ap.append(ep / (ep + en))
        an.append(en / (ep + en))
    return ap, an


def hand_pnb_multilabel(ap: list, an: list, mu: float, logits=ML_LOGITS, targets=ML_TARGETS) -> float:
    total = 0.0
    for j in range(len(ap)):
        rows = [(r[j], y[j]) for r, y in zip(logits, targets, strict=True) if not math.isnan(y[j])]
        if not rows:
            continue
        pos = sum(y * bce_terms(x)[0] for x, y in rows) / len(rows)
        neg = sum((1 - y) * bce_terms(x)[1] for x, y in rows) / len(rows)
        total += mu * ap[j] * (ap[j] * pos + an[j] * neg)
    return total


def test_pnb_multilabel_hand_value_text_negatives() -> None:
    beta, mu = 0.9, 4.0
    ctx = ml_ctx(class_counts=np.array([2, 1, 3]), num_samples=4)
    ap, an = hand_alphas([2, 1, 3], [2, 3, 1], beta)  # negatives = N_k - n_j
    loss = build_loss("pnb", ctx, negatives="text", beta=beta, mu=mu)
    assert loss.alpha_pos.tolist() == pytest.approx(ap, rel=1e-6)
    assert loss.alpha_neg.tolist() == pytest.approx(an, rel=1e-6)
    got = loss(t(ML_LOGITS), t(ML_TARGETS))
    assert got.item() == pytest.approx(hand_pnb_multilabel(ap, an, mu), rel=1e-6)


def test_pnb_negatives_text_vs_code() -> None:
    beta, mu = 0.9, 4.0
    ctx = ml_ctx(class_counts=np.array([3, 2, 1]), num_samples=4)  # sum of positives 6 != N_k 4
    text = build_loss("pnb", ctx, negatives="text", beta=beta, mu=mu)
    code = build_loss("pnb", ctx, negatives="code", beta=beta, mu=mu)
    ap_t, _ = hand_alphas([3, 2, 1], [1, 2, 3], beta)
    ap_c, _ = hand_alphas([3, 2, 1], [3, 4, 5], beta)
    assert text.alpha_pos.tolist() == pytest.approx(ap_t, rel=1e-6)
    assert code.alpha_pos.tolist() == pytest.approx(ap_c, rel=1e-6)
    # more negatives under "code" -> every class's positives weigh more
    assert torch.all(code.alpha_pos > text.alpha_pos)
    z, y = t(ML_LOGITS), t(ML_TARGETS)
    assert text(z, y).item() != pytest.approx(code(z, y).item(), rel=1e-3)


def test_pnb_equal_positives_and_negatives_reduces_to_halves() -> None:
    mu = 4.0
    ctx = ml_ctx(class_counts=np.array([2, 2, 2]), num_samples=4)
    loss = build_loss("pnb", ctx, beta=0.9999, mu=mu)
    assert loss.alpha_pos.tolist() == pytest.approx([0.5] * 3)
    assert loss.alpha_neg.tolist() == pytest.approx([0.5] * 3)
    expected = hand_pnb_multilabel([0.5] * 3, [0.5] * 3, mu)
    # the same as sum_j mu * 0.5 * (0.5 * BCE_pos_j + 0.5 * BCE_neg_j)
    assert loss(t(ML_LOGITS), t(ML_TARGETS)).item() == pytest.approx(expected, rel=1e-6)


def test_pnb_zero_count_class_drops_out() -> None:
    ctx = ml_ctx(
        class_counts=np.array([2, 0, 4]), num_samples=4
    )  # class 1: no positives, class 2: no negatives
    loss = build_loss("pnb", ctx, beta=0.9999999, a=10.0)
    assert loss.alpha_pos[1].item() == 0.0 and loss.alpha_neg[1].item() == 0.0
    assert loss.alpha_pos[2].item() == 0.0 and loss.alpha_neg[2].item() == 0.0
    assert loss.alpha_pos[0].item() == pytest.approx(0.5)
    z = t(ML_LOGITS, grad=True)
    value = loss(z, t(ML_TARGETS))
    value.backward()
    assert math.isfinite(value.item())
    assert torch.all(z.grad[:, 1:] == 0)
    assert torch.all(z.grad[:, 0] != 0)


def test_pnb_multiclass_hand_value_and_global_negatives() -> None:
    beta, mu = 0.9, 2.0
    ctx = mc_ctx(global_class_counts=np.array([5, 4, 2]), global_num_samples=11)
    ap, _ = hand_alphas([3, 1, 0], [1, 3, 4], beta)  # negatives = N_k - n_c
    loss = build_loss("pnb", ctx, beta=beta, mu=mu)
    expected = np.mean(
        [mu * ap[y] * -math.log(softmax(z)[y]) for z, y in zip(MC_LOGITS, MC_TARGETS, strict=True)]
    )
    assert loss(t(MC_LOGITS), torch.tensor(MC_TARGETS)).item() == pytest.approx(expected, rel=1e-6)
    glob = build_loss("pnb", ctx, negatives="global", beta=beta, mu=mu)
    ap_g, _ = hand_alphas([3, 1, 0], [2, 3, 2], beta)  # negatives = class-c samples at other clients
    assert glob.alpha_pos.tolist() == pytest.approx(ap_g, rel=1e-6)


def test_pnb_global_negatives_need_histogram_and_multiclass() -> None:
    with pytest.raises(ValueError, match="global_class_counts"):
        build_loss("pnb", mc_ctx(), negatives="global")
    with pytest.raises(ValueError, match="multiclass only"):
        build_loss(
            "pnb", ml_ctx(global_class_counts=np.array([3, 3, 3]), global_num_samples=9), negatives="global"
        )
    with pytest.raises(ValueError, match="negatives must be one of"):
        build_loss("pnb", ml_ctx(), negatives="both")


# ---------------------------------------------------------------- DAFL


def test_dafl_gamma_zero_and_c_zero_equals_ce() -> None:
    loss = DAFLLoss("multiclass", np.zeros(3), gamma=0.0)
    z, y = t(MC_LOGITS), torch.tensor(MC_TARGETS)
    assert loss(z, y).item() == pytest.approx(F.cross_entropy(z, y).item(), rel=1e-6)


def _local_c_k(counts: list[int], n: int) -> float:
    """c_k with the 'half' rule: a missing class counts (2 max(N_k, C) - 1)."""
    return float(np.mean([(n - c) / c if c > 0 else 2 * max(n, len(counts)) - 1 for c in counts]))


def test_dafl_multiclass_hand_value_site_c_k_and_global_c_class() -> None:
    """Default client_term="local": c_i = lam c_k + (1 - lam) c_class_i with the site's own c_k."""
    ctx = mc_ctx(global_class_counts=np.array([6, 3, 1]), global_num_samples=10, client_level_parameter=2.0)
    lam = 0.5
    c_k = _local_c_k([3, 1, 0], 4)  # (1/3 + 3 + 7) / 3
    c_class = [(10 - 6) / 6, (10 - 3) / 3, (10 - 1) / 1]
    w = [1 + lam * c_k + (1 - lam) * cc for cc in c_class]
    loss = build_loss("dafl", ctx)  # multiclass default: raw weights, as in the paper
    assert loss.class_weights.tolist() == pytest.approx(w, rel=1e-6)
    terms = []
    for z, y in zip(MC_LOGITS, MC_TARGETS, strict=True):
        p = softmax(z)[y]
        terms.append(-w[y] * (1 - p) ** 2 * math.log(p))
    assert loss(t(MC_LOGITS), torch.tensor(MC_TARGETS)).item() == pytest.approx(np.mean(terms), rel=1e-6)
    assert loss.info["c_client_source"] == "local" and loss.info["c_class_source"] == "global"


def test_dafl_client_term_global_uses_the_federations_c_client() -> None:
    ctx = mc_ctx(global_class_counts=np.array([6, 3, 1]), global_num_samples=10, client_level_parameter=2.0)
    c_class = [(10 - 6) / 6, (10 - 3) / 3, (10 - 1) / 1]
    loss = build_loss("dafl", ctx, client_term="global")
    assert loss.class_weights.tolist() == pytest.approx([1 + 1.0 + 0.5 * cc for cc in c_class], rel=1e-6)
    assert loss.info["c_client_source"] == "global"
    with pytest.raises(ValueError, match="client_term must be one of .*'site'"):
        build_loss("dafl", ctx, client_term="site")


def test_dafl_falls_back_to_local_statistics() -> None:
    loss = build_loss("dafl", mc_ctx(), lam=0.25, client_term="global")
    c_k = _local_c_k([3, 1, 0], 4)
    c_class = [(4 - 3) / 3, (4 - 1) / 1, 0.0]
    w = [1 + 0.25 * c_k + 0.75 * cc for cc in c_class]
    assert loss.info["c_client_source"] == "local" and loss.info["c_class_source"] == "local"
    assert loss.info["c_client"] == pytest.approx(c_k)
    assert loss.class_weights.tolist() == pytest.approx(w, rel=1e-6)


ML_GLOBAL = dict(global_class_counts=np.array([20, 2, 50]), global_num_samples=100)


def _ml_weights(normalize: str) -> tuple[list[float], float]:
    """Positive weights and negative weight of ml_ctx(**ML_GLOBAL) by hand."""
    c_k = _local_c_k([2, 1, 0], 4)  # (1 + 3 + 7) / 3
    raw = [1 + 0.5 * c_k + 0.5 * (100 - n) / n for n in (20, 2, 50)]
    if normalize == "none":
        return raw, 1.0
    if normalize == "mean":
        return [r / np.mean(raw) for r in raw], 1.0
    q = [2 / 4, 1 / 4, 0 / 4]  # the site's prevalence
    scale = np.mean([qj * r + (1 - qj) for qj, r in zip(q, raw, strict=True)])
    return [r / scale for r in raw], 1.0 / scale


@pytest.mark.parametrize("normalize", ["entries", "mean", "none"])
def test_dafl_multilabel_hand_value(normalize: str) -> None:
    w, v = _ml_weights(normalize)
    terms = []
    for row_x, row_y in zip(ML_LOGITS, ML_TARGETS, strict=True):
        for j, (x, y) in enumerate(zip(row_x, row_y, strict=True)):
            if math.isnan(y):
                continue
            s = sig(x)
            terms.append(-w[j] * y * (1 - s) ** 2 * math.log(s) - v * (1 - y) * s**2 * math.log(1 - s))
    loss = build_loss("dafl", ml_ctx(**ML_GLOBAL), normalize=normalize)
    assert loss.class_weights.tolist() == pytest.approx(w, rel=1e-6)
    assert loss.negative_weight.item() == pytest.approx(v, rel=1e-6)
    assert loss(t(ML_LOGITS), t(ML_TARGETS)).item() == pytest.approx(sum(terms) / len(terms), rel=1e-6)


def test_dafl_multilabel_default_keeps_the_positive_negative_ratio() -> None:
    """A positive entry of finding j weighs (1 + c_j) times a negative one with the mirrored logit
    (the focal terms are then equal), as the unnormalised loss says. Normalising the positive weights
    to mean 1 (the earlier default, "mean") shrinks the ratio to (1 + c_j) / mean(1 + c): ~1 on average."""
    ctx = ml_ctx(global_class_counts=np.array([900, 1, 30]), global_num_samples=1000)
    loss = build_loss("dafl", ctx)
    assert loss.normalize == "entries"
    raw = 1.0 + np.array(loss.info["c_class"]) * 0.5 + 0.5 * float(loss.info["c_client"])
    z = 0.7
    for j in range(3):
        pos_logits = torch.zeros(1, 3)
        pos_logits[0, j] = z
        pos_target = torch.full((1, 3), NAN)
        pos_target[0, j] = 1.0
        neg_logits = -pos_logits
        neg_target = pos_target.clone()
        neg_target[0, j] = 0.0
        ratio = loss(pos_logits, pos_target).item() / loss(neg_logits, neg_target).item()
        assert ratio == pytest.approx(raw[j], rel=1e-5)
        old = build_loss("dafl", ctx, normalize="mean")
        old_ratio = old(pos_logits, pos_target).item() / old(neg_logits, neg_target).item()
        assert old_ratio == pytest.approx(raw[j] / raw.mean(), rel=1e-5)
    # the mean weight of a label entry on the site's own data is 1
    q = ctx.class_counts / ctx.num_samples
    mean_entry = np.mean(q * loss.class_weights.numpy() + (1 - q) * loss.negative_weight.item())
    assert mean_entry == pytest.approx(1.0, rel=1e-6)
    assert torch.argmax(loss.class_weights).item() == 1  # the rarest finding weighs most


def test_dafl_learnable_gamma_and_update_context() -> None:
    ctx = mc_ctx(global_class_counts=np.array([6, 3, 1]), global_num_samples=10, client_level_parameter=2.0)
    loss = build_loss("dafl", ctx, learnable_gamma=True, client_term="global")
    params = list(loss.parameters())
    assert len(params) == 1 and params[0].item() == pytest.approx(2.0)
    z = t([[50.0, -50.0, 0.0], [0.2, 0.4, 0.1], [-0.5, 1.5, 0.3]], grad=True)
    value = loss(z, torch.tensor(MC_TARGETS))
    value.backward()
    assert torch.isfinite(params[0].grad) and params[0].grad.item() != 0
    assert torch.isfinite(z.grad).all()
    before = loss.class_weights.clone()
    loss.update_context(
        mc_ctx(global_class_counts=np.array([2, 4, 4]), global_num_samples=10, client_level_parameter=1.0)
    )
    assert not torch.allclose(before, loss.class_weights)
    assert loss.class_weights[0].item() == pytest.approx(1 + 0.5 * 1.0 + 0.5 * 8 / 2)
    assert list(loss.parameters())[0] is params[0]


def test_dafl_l1_penalty() -> None:
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, -2.0]]))
        model.bias.fill_(-1.0)
    loss = build_loss("dafl", mc_ctx(), l1=1e-6)
    assert loss.penalty(model).item() == pytest.approx(1e-6 * 3.5, rel=1e-6)
    assert build_loss("dafl", mc_ctx()).penalty(model).item() == 0.0
    assert build_loss("pnb", mc_ctx()).penalty(model).item() == 0.0


# ---------------------------------------------------------------- all losses: masking, finiteness, gradients

ML_NAMES = ["bce", "focal", "class_balanced", "pnb", "dafl"]
MC_NAMES = ["ce", "focal", "class_balanced", "pnb", "dafl"]


@pytest.mark.parametrize("name", ML_NAMES)
def test_nan_targets_are_ignored(name: str) -> None:
    loss = build_loss(name, ml_ctx(global_class_counts=np.array([5, 2, 1]), global_num_samples=9))
    z = t(ML_LOGITS, grad=True)
    value = loss(z, t(ML_TARGETS))
    value.backward()
    assert math.isfinite(value.item())
    assert z.grad[0, 2].item() == 0.0 and z.grad[2, 1].item() == 0.0
    moved = torch.tensor(ML_LOGITS)
    moved[0, 2] = 30.0
    moved[2, 1] = -30.0
    assert loss(moved, t(ML_TARGETS)).item() == pytest.approx(value.item(), rel=1e-6)
    all_nan = torch.full((2, 3), NAN)
    assert loss(torch.zeros(2, 3), all_nan).item() == 0.0


@pytest.mark.parametrize("scale", [1.0, 1e2, 1e4])
@pytest.mark.parametrize("name", ML_NAMES)
def test_multilabel_finite_loss_and_gradients_for_extreme_logits(name: str, scale: float) -> None:
    options = {"beta": 0.9999999} if name in ("pnb", "class_balanced") else {}
    loss = build_loss(name, ml_ctx(class_counts=np.array([2, 0, 4]), num_samples=4), **options)
    z = (torch.tensor([[1.0, -1.0, 1.0], [-1.0, 1.0, -1.0]]) * scale).requires_grad_(True)
    y = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, NAN]])  # confidently wrong predictions
    value = loss(z, y)
    value.backward()
    assert math.isfinite(value.item())
    assert torch.isfinite(z.grad).all()


@pytest.mark.parametrize("scale", [1.0, 1e2, 1e4])
@pytest.mark.parametrize("name", MC_NAMES)
def test_multiclass_finite_loss_and_gradients_for_extreme_logits(name: str, scale: float) -> None:
    loss = build_loss(name, mc_ctx())
    z = (torch.tensor([[1.0, -1.0, 0.0], [-1.0, 1.0, 0.0], [1.0, 0.0, -1.0]]) * scale).requires_grad_(True)
    y = torch.tensor([1, 0, 0])  # wrong, wrong, right
    value = loss(z, y)
    value.backward()
    assert math.isfinite(value.item())
    assert torch.isfinite(z.grad).all()
    assert z.grad.abs().sum().item() > 0


# ---------------------------------------------------------------- registry and validation


def test_registry_names_and_errors() -> None:
    assert set(LOSSES) == {"bce", "ce", "focal", "class_balanced", "pnb", "dafl"}
    with pytest.raises(KeyError, match="known losses: bce, ce, class_balanced, dafl, focal, pnb"):
        build_loss("ldam", ml_ctx())
    with pytest.raises(TypeError, match="unknown option"):
        build_loss("pnb", ml_ctx(), tau=10)
    with pytest.raises(ValueError, match="supports task"):
        build_loss("bce", mc_ctx())
    with pytest.raises(ValueError, match="supports task"):
        build_loss("ce", ml_ctx())


def test_context_validation_messages() -> None:
    with pytest.raises(ValueError, match="class_counts must have shape"):
        ml_ctx(class_counts=np.array([1, 2]))
    with pytest.raises(ValueError, match="non-negative"):
        ml_ctx(class_counts=np.array([1, -1, 0]))
    with pytest.raises(ValueError, match="exceed num_samples"):
        ml_ctx(class_counts=np.array([5, 0, 0]))
    with pytest.raises(ValueError, match="non-finite"):
        ml_ctx(class_counts=np.array([1, NAN, 0]))
    with pytest.raises(ValueError, match="task must be one of"):
        ml_ctx(task="regression")


def test_forward_checks_shapes_and_ranges() -> None:
    with pytest.raises(ValueError, match="built for 3 classes"):
        build_loss("pnb", ml_ctx())(torch.zeros(2, 4), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="targets must lie in"):
        build_loss("dafl", mc_ctx())(torch.zeros(2, 3), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="logits' shape"):
        build_loss("bce", ml_ctx())(torch.zeros(2, 3), torch.zeros(3, 3))


def test_class_balanced_accepts_plain_counts() -> None:
    loss = ClassBalancedLoss("multiclass", np.array([0, 0, 0]))
    assert loss.class_weights.tolist() == [0.0, 0.0, 0.0]
    value = loss(t(MC_LOGITS, grad=True), torch.tensor(MC_TARGETS))
    assert value.item() == 0.0


def test_pnb_constructor_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="differ in shape"):
        PNBLoss("multilabel", np.array([1, 2]), np.array([1, 2, 3]))


def test_bce_and_ce_state_their_task_and_name_themselves_when_refusing_the_other() -> None:
    """``task`` is the one the loss was built for; the refusal names the loss, the tasks it supports
    and the task it got (the whole message)."""
    assert build_loss("bce", ml_ctx()).task == "multilabel"
    assert build_loss("ce", mc_ctx()).task == "multiclass"
    refusals = (
        ("bce", mc_ctx(), "'bce'", "('multilabel',)", "'multiclass'"),
        ("ce", ml_ctx(), "'ce'", "('multiclass',)", "'multilabel'"),
    )
    for name, ctx, quoted, supported, got in refusals:
        with pytest.raises(ValueError) as refused:
            build_loss(name, ctx)
        assert str(refused.value) == f"loss {quoted} supports task(s) {supported}, got {got}"


def test_ce_of_an_empty_batch_is_zero_with_gradients() -> None:
    """A batch without images gives loss 0 (not NaN) that still backpropagates."""
    logits = torch.zeros(0, 3, requires_grad=True)
    value = build_loss("ce", mc_ctx())(logits, torch.zeros(0, dtype=torch.int64))
    assert value.item() == 0.0
    value.backward()
    assert logits.grad is not None and logits.grad.shape == (0, 3)
