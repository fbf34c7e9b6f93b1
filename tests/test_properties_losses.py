"""Property-based tests (Hypothesis) of what every client loss claims for any statistics and batch
(docs/methods.md, "Losses"):

- the loss and its gradient are finite for any finite logits (up to |logit| = 1e4), and the loss is
  non-negative (every term is a non-negative weight times -log of a probability);
- a NaN target contributes neither to the loss nor to its gradient;
- the loss is a mean over the batch (the order of the samples does not matter) and treats the
  classes alike (permuting the classes with their statistics leaves it unchanged);
- focal with gamma = 0 is BCE / CE;
- the class weights: class-balanced ones sum to C, are 0 for an absent class and never rise with
  the count; PNB's alpha_p + alpha_n = 1 where both counts are positive; DAFL's "entries"
  normalisation gives the site's label entries a mean weight of 1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fedweigh.losses import LossContext, build_loss, class_balanced_weights, pnb_alphas

SOME = settings(max_examples=30, deadline=None)
#: per loss, reading and task (17 of them)
EACH = settings(max_examples=15, deadline=None)

#: Every loss and the readings its docs describe, as (name, options), per task.
MULTILABEL = (
    ("bce", {}),
    ("focal", {}),
    ("focal", {"gamma": 0.5, "alpha": 0.25}),
    ("class_balanced", {}),
    ("class_balanced", {"beta": 0.99, "weight_negatives": True}),
    ("pnb", {}),
    ("pnb", {"negatives": "code", "beta": 0.9999999, "a": 10.0}),
    ("dafl", {}),
    ("dafl", {"normalize": "mean", "client_term": "global", "missing": "floor1"}),
    ("dafl", {"normalize": "none", "gamma": 0.0, "lam": 0.2}),
)
MULTICLASS = (
    ("ce", {}),
    ("focal", {}),
    ("class_balanced", {}),
    ("pnb", {}),
    ("pnb", {"negatives": "global"}),
    ("dafl", {}),
    ("dafl", {"normalize": "entries", "gamma": 1.0}),
)


def loss_id(spec: tuple[str, dict]) -> str:
    name, options = spec
    return name + "".join(f":{k}={v}" for k, v in options.items())


@st.composite
def clients(draw, task: str):
    """A site's statistics (and the federation's) and a batch: logits up to |1e4|, targets with
    NaNs (multi-label) or class indices (multi-class)."""
    c = draw(st.integers(2, 6))
    if task == "multilabel":
        counts = draw(st.lists(st.integers(0, 500), min_size=c, max_size=c))
        n = max(counts) + draw(st.integers(0, 500))
    else:
        counts = draw(st.lists(st.integers(0, 500), min_size=c, max_size=c))
        n = sum(counts)
    assume(n > 0)
    others = draw(st.lists(st.integers(0, 2_000), min_size=c, max_size=c))
    ctx = LossContext(
        task=task,
        num_classes=c,
        class_counts=np.asarray(counts),
        num_samples=n,
        global_class_counts=np.asarray(counts) + np.asarray(others),
        global_num_samples=n + max(others) + 1,
        client_level_parameter=draw(st.floats(0.0, 50.0)),
    )
    b = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from((0.1, 3.0, 50.0, 1e4)))
    rng = np.random.default_rng(seed)
    logits = torch.tensor(rng.normal(0.0, scale, (b, c)), dtype=torch.float32)
    if task == "multilabel":
        y = rng.integers(0, 2, (b, c)).astype(np.float32)
        y[rng.random((b, c)) < draw(st.sampled_from((0.0, 0.3)))] = np.nan
        targets = torch.tensor(y)
    else:
        targets = torch.tensor(rng.integers(0, c, b))
    return ctx, logits, targets


def loss_and_grad(spec, ctx, logits, targets):
    name, options = spec
    fn = build_loss(name, ctx, **options)
    z = logits.clone().requires_grad_(True)
    value = fn(z, targets)
    value.backward()
    return fn, float(value.detach()), z.grad


def cases(task: str, specs):
    return pytest.mark.parametrize("spec", specs, ids=loss_id)


@cases("multilabel", MULTILABEL)
@EACH
@given(data=clients("multilabel"))
def test_multilabel_losses_are_finite_nonnegative_and_ignore_nan_targets(spec, data):
    ctx, logits, targets = data
    _, value, grad = loss_and_grad(spec, ctx, logits, targets)
    assert np.isfinite(value) and value >= 0.0
    assert torch.isfinite(grad).all()
    unknown = torch.isnan(targets)
    assert torch.all(grad[unknown] == 0)
    moved = logits.clone()
    moved[unknown] = -moved[unknown] + 7.0  # change the logits of the unknown entries only
    _, again, _ = loss_and_grad(spec, ctx, moved, targets)
    assert again == pytest.approx(value, rel=1e-6, abs=1e-7)


@cases("multiclass", MULTICLASS)
@EACH
@given(data=clients("multiclass"))
def test_multiclass_losses_are_finite_and_nonnegative(spec, data):
    ctx, logits, targets = data
    _, value, grad = loss_and_grad(spec, ctx, logits, targets)
    assert np.isfinite(value) and value >= 0.0
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize(
    ("task", "spec"),
    [("multilabel", s) for s in MULTILABEL] + [("multiclass", s) for s in MULTICLASS],
    ids=lambda x: x if isinstance(x, str) else loss_id(x),
)
@EACH
@given(data=st.data())
def test_losses_are_means_over_the_batch_and_treat_classes_alike(task, spec, data):
    """Shuffling the samples, or relabelling the classes together with every statistic, leaves the
    loss unchanged; a batch twice over has the loss of the batch."""
    ctx, logits, targets = data.draw(clients(task))
    _, value, _ = loss_and_grad(spec, ctx, logits, targets)
    b, c = logits.shape
    rows = torch.tensor(data.draw(st.permutations(range(b))))
    _, shuffled, _ = loss_and_grad(spec, ctx, logits[rows], targets[rows])
    assert shuffled == pytest.approx(value, rel=1e-5, abs=1e-6)
    _, doubled, _ = loss_and_grad(spec, ctx, torch.cat([logits, logits]), torch.cat([targets, targets]))
    assert doubled == pytest.approx(value, rel=1e-5, abs=1e-6)
    perm = np.asarray(data.draw(st.permutations(range(c))))
    relabelled = LossContext(
        task=ctx.task,
        num_classes=c,
        class_counts=ctx.class_counts[perm],
        num_samples=ctx.num_samples,
        global_class_counts=ctx.global_class_counts[perm],
        global_num_samples=ctx.global_num_samples,
        client_level_parameter=ctx.client_level_parameter,
    )
    if task == "multilabel":
        new_targets = targets[:, perm]
    else:
        new_targets = torch.tensor(np.argsort(perm))[targets]  # old class perm[j] is new class j
    _, moved, _ = loss_and_grad(spec, relabelled, logits[:, perm], new_targets)
    assert moved == pytest.approx(value, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("task", ("multilabel", "multiclass"))
@SOME
@given(data=st.data())
def test_focal_with_gamma_zero_is_cross_entropy(task, data):
    ctx, logits, targets = data.draw(clients(task))
    plain = "bce" if task == "multilabel" else "ce"
    _, focal, _ = loss_and_grad(("focal", {"gamma": 0.0}), ctx, logits, targets)
    _, reference, _ = loss_and_grad((plain, {}), ctx, logits, targets)
    # two float32 formulas of one value: a few ulps apart (a case 2e-7 apart at a loss near 0.1 was found)
    assert focal == pytest.approx(reference, rel=1e-5, abs=1e-6)


counts_vectors = st.lists(st.integers(0, 100_000), min_size=1, max_size=14)


@SOME
@given(counts=counts_vectors, beta=st.floats(0.5, 0.99999))
def test_class_balanced_weights_sum_to_c_and_fall_with_the_count(counts, beta):
    """w_c = (1 - beta) / (1 - beta^n_c), 0 for n_c = 0, scaled to sum to C; more samples, less weight."""
    n = np.asarray(counts, dtype=np.float64)
    w = class_balanced_weights(n, beta)
    if not np.any(n > 0):
        np.testing.assert_array_equal(w, np.zeros(n.size))
        return
    assert w.sum() == pytest.approx(n.size, rel=1e-12)
    assert np.all(w[n == 0] == 0.0) and np.all(w[n > 0] > 0.0)
    raw = np.where(n > 0, (1 - beta) / (1 - beta ** np.where(n > 0, n, 1.0)), 0.0)
    np.testing.assert_allclose(w, raw * n.size / raw.sum(), rtol=1e-8)
    present = np.flatnonzero(n > 0)
    order = present[np.argsort(n[present], kind="stable")]
    assert np.all(np.diff(w[order]) <= 1e-12 * n.size)


@SOME
@given(
    pos=st.lists(st.integers(0, 100_000), min_size=1, max_size=14),
    neg=st.lists(st.integers(0, 100_000), min_size=1, max_size=14),
    beta=st.floats(0.5, 0.99999),
    a=st.floats(0.5, 20.0),
)
def test_pnb_alphas_split_one_between_positives_and_negatives(pos, neg, beta, a):
    """alpha_p = E^-1(n+) / (E^-1(n+) + E^-1(n-)), E^-1(n) = (1 - beta) / (1 - beta^(n / a)):
    alpha_p + alpha_n = 1 where n+ > 0 and n- > 0, both 0 otherwise; the rarer side weighs more."""
    k = min(len(pos), len(neg))
    p, n = np.asarray(pos[:k], dtype=np.float64), np.asarray(neg[:k], dtype=np.float64)
    alpha_p, alpha_n = pnb_alphas(p, n, beta, a)
    active = (p > 0) & (n > 0)
    np.testing.assert_allclose((alpha_p + alpha_n)[active], 1.0, rtol=1e-12)
    assert np.all(alpha_p[~active] == 0) and np.all(alpha_n[~active] == 0)
    inv = lambda x: (1 - beta) / (1 - beta ** (x / a))  # noqa: E731
    for j in np.flatnonzero(active):
        assert alpha_p[j] == pytest.approx(inv(p[j]) / (inv(p[j]) + inv(n[j])), rel=1e-8)
        if p[j] < n[j]:
            assert alpha_p[j] >= 0.5 - 1e-12
        elif p[j] > n[j]:
            assert alpha_p[j] <= 0.5 + 1e-12


@pytest.mark.parametrize("task", ("multilabel", "multiclass"))
@SOME
@given(data=st.data(), lam=st.floats(0.0, 1.0))
def test_dafl_weights_are_one_plus_c_and_entries_average_to_one(task, data, lam):
    """w_i = 1 + c_i >= 1 ("none"); "entries" divides by S so that the mean weight of the site's
    label entries is 1: mean_j [q_j w_j + (1 - q_j) v] = 1 (multi-label), sum_c q_c w_c = 1."""
    ctx, _, _ = data.draw(clients(task))
    raw = build_loss("dafl", ctx, normalize="none", lam=lam)
    w = raw.class_weights.double().numpy()
    assert np.all(w >= 1.0 - 1e-6) and float(raw.negative_weight) == 1.0
    entries = build_loss("dafl", ctx, normalize="entries", lam=lam)
    we = entries.class_weights.double().numpy()
    v = float(entries.negative_weight)
    q = ctx.class_counts / ctx.num_samples
    mean_weight = np.mean(q * we + (1 - q) * v) if task == "multilabel" else np.sum(q * we)
    assert mean_weight == pytest.approx(1.0, rel=1e-5)
    np.testing.assert_allclose(we / we.max(), w / w.max(), rtol=1e-5)  # one common divisor
    if task == "multilabel":
        np.testing.assert_allclose(we / v, w, rtol=1e-5)  # a positive still weighs w_j negatives
