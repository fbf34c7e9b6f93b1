"""Differential privacy: DP-SGD accounting across rounds and relaunches, per-sample gradients, FedProx
under DP, the Gaussian mechanism on label statistics and its wiring into the statistics task."""

from __future__ import annotations

import copy
import json
import math
import shlex
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant
from scipy.stats import norm

from fedweigh.data.base import LabeledImages, SiteData
from fedweigh.errors import PrivacyBudgetExhausted
from fedweigh.models import build_model
from fedweigh.secure.accountant import dp_state_path
from fedweigh.secure.dp_config import DPConfig, StatsDPConfig
from fedweigh.secure.dp_sgd import DPSGD
from fedweigh.secure.gaussian import (
    analytic_gaussian_sigma,
    classic_gaussian_sigma,
    gaussian_delta,
    gaussian_sigma,
    histogram_sensitivity,
    privatize_histogram,
)
from fedweigh.secure.grad_sample import (
    FastGradSampler,
    PerSampleLoss,
    clipped_mean_gradient,
    dp_optimizer_class,
)
from fedweigh.secure.stats_release import HistogramReleaser
from fedweigh.site.args import ClientArgs, parse_args
from fedweigh.site.trainer import SiteTrainer
from fedweigh.train import TrainConfig, default_loss, get_params, set_params, train_local

torch.set_num_threads(1)

SIZE = 16  # the compact DenseNet's smallest input side


def images(n: int, classes: int = 3, task: str = "multilabel", seed: int = 0) -> LabeledImages:
    rng = np.random.default_rng(seed)
    x = rng.random((n, 1, SIZE, SIZE), dtype=np.float32)
    names = tuple(f"c{i}" for i in range(classes))
    if task == "multilabel":
        return LabeledImages(x, (rng.random((n, classes)) < 0.4).astype(np.float32), names, task)
    return LabeledImages(x, (np.arange(n) % classes).astype(np.int64), names, task)


def site_data(n: int = 32) -> SiteData:
    return SiteData(name="site-1", train=images(n), val=images(6, seed=1))


def dp_args(**overrides) -> ClientArgs:
    base = {"size": SIZE, "batch_size": 2, "max_steps": 2, "eval_test": False, "dp_epsilon": 3.0}
    return ClientArgs(**{**base, **overrides})


def fresh_accountant_epsilon(history: list, delta: float) -> float:
    acc = RDPAccountant()
    acc.history = [tuple(h) for h in history]
    return acc.get_epsilon(delta=delta)


# ----------------------------------------------------------------------------------------- DP-SGD
def test_reported_epsilon_is_the_accountants_across_rounds_and_a_relaunch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = dp_args()
    assert args.norm == "group"  # made Opacus-compatible automatically
    site = site_data(128)  # batch 2 -> Poisson rate q = 1/64, 64 steps per epoch, capped at 2 per round
    trainer = SiteTrainer(site, images(4, seed=2), args, job_id="job-1")
    params = get_params(trainer.model)
    q, total_rounds, steps = 1 / 64, 4, 2
    seen, sigma = [], None
    for r in range(3):
        out = trainer.run_round(params, r, {}, total_rounds=total_rounds)
        params = out.params
        assert out.num_steps == steps
        sigma = sigma or out.metrics["dp_noise_multiplier"]  # computed once, for 4 rounds x 2 steps
        state = json.loads(dp_state_path("job-1", "site-1").read_text())
        assert state["history"] == [[sigma, q, steps * (r + 1)]]
        assert out.metrics["dp_epsilon"] == fresh_accountant_epsilon(state["history"], 1e-5)
        seen.append(out.metrics["dp_epsilon"])
    assert 0 < seen[0] < seen[1] < seen[2] < 3.0

    relaunched = SiteTrainer(site, images(4, seed=2), args)  # a new client process in the same folder
    relaunched.job_id = "job-1"  # set after construction, as before: still names the job's files
    out = relaunched.run_round(params, 3, {"total_rounds": total_rounds})  # total_rounds via the plan
    expected = fresh_accountant_epsilon([(sigma, q, 8)], 1e-5)
    assert out.metrics["dp_epsilon"] == expected and out.metrics["dp_noise_multiplier"] == sigma
    # the planned last round ends at the target, within get_noise_multiplier's tolerance (0.01)
    assert seen[2] < expected <= 3.0 and expected > 3.0 - 0.011

    with pytest.raises(PrivacyBudgetExhausted, match="site-1.*budget exhausted"):
        relaunched.run_round(out.params, 4, {}, total_rounds=total_rounds)


def test_dp_disabled_trains_exactly_as_before(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ClientArgs(size=SIZE, batch_size=4, max_steps=3, eval_test=False)
    assert args.norm == "batch" and "dp" not in args.to_argv()
    site = site_data(16)
    trainer = SiteTrainer(site, images(4, seed=2), args)
    start = get_params(trainer.model)
    reference = copy.deepcopy(trainer.model)
    out = trainer.run_round(start, 0, {}, total_rounds=5)
    assert not any(k.startswith("dp_") for k in out.metrics)
    assert trainer.dp_report is None and not list(tmp_path.glob("fedweigh_dp_*"))

    from fedweigh.site.trainer import round_seed

    set_params(reference, start)
    cfg = TrainConfig(epochs=1, batch_size=4, lr=args.lr, max_steps=3, seed=round_seed(0, "site-1", 0))
    train_local(reference, site.train, cfg)
    for key, value in get_params(reference).items():
        np.testing.assert_array_equal(out.params[key], value)


def test_client_args_dp_flags_round_trip_and_need_total_rounds():
    args = ClientArgs(dp_epsilon=2.5, dp_delta=1e-6, dp_mode="hooks", stats_dp_epsilon=0.5)
    assert args.norm == "group"
    assert parse_args(shlex.split(args.to_argv())) == args
    assert (
        ClientArgs(arch="vit", dp_noise_multiplier=1.0).norm == "batch"
    )  # the ViT has no BatchNorm to replace
    with pytest.raises(ValueError, match="exactly one of epsilon"):
        DPConfig(epsilon=1.0, noise_multiplier=1.0)
    dp = DPSGD(DPConfig(epsilon=1.0), None, site_name="site-7")
    model = build_model("densenet_compact", 3, img_size=SIZE, norm="group", seed=0)
    with pytest.raises(ValueError, match="site-7.*total_rounds"):
        dp.train_round(model, images(8), TrainConfig(batch_size=2, max_steps=1))
    batchnorm = build_model("densenet_compact", 3, img_size=SIZE, norm="batch", seed=0)
    with pytest.raises(ValueError, match="site-7.*norm='group'"):
        dp.train_round(batchnorm, images(8), TrainConfig(batch_size=2, max_steps=1), total_rounds=2)


def brute_force_clipped_mean(model, x, y, max_grad_norm):
    """(1/B) sum_i clip(g_i): one backward per sample, the definition."""
    loss = PerSampleLoss(default_loss("multilabel"), "multilabel")
    params = dict(model.named_parameters())
    total = {k: torch.zeros_like(p) for k, p in params.items()}
    clipped = 0
    for i in range(x.shape[0]):
        model.zero_grad()
        loss(model(x[i : i + 1]), y[i : i + 1]).backward()
        g_norm = float(sum((p.grad**2).sum() for p in params.values()) ** 0.5)
        factor = min(1.0, max_grad_norm / (g_norm + 1e-6))
        clipped += factor < 1.0
        for k, p in params.items():
            total[k] += factor * p.grad / x.shape[0]
    return total, clipped


@pytest.mark.parametrize("norm_kind", ["group", "instance"])
def test_clipped_gradients_agree_across_modes_and_with_the_definition(norm_kind):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 1, SIZE, SIZE, generator=g)
    y = (torch.rand(4, 3, generator=g) < 0.4).float()
    y[1, 2] = float("nan")  # an unknown label: the masked mean is taken per sample
    model = build_model("densenet_compact", 3, img_size=SIZE, norm=norm_kind, seed=0)
    truth, clipped = brute_force_clipped_mean(copy.deepcopy(model), x, y, 0.05)
    assert clipped >= 2  # the bound is active
    scale = float(sum((t**2).sum() for t in truth.values()) ** 0.5)
    modes = ["fast", "hooks", "ghost", "functorch"] if norm_kind == "group" else ["fast", "hooks"]
    for mode in modes:
        got = clipped_mean_gradient(model, x, y, mode, 0.05)
        assert set(got) == set(truth)
        err = float(sum(((got[k] - truth[k]) ** 2).sum() for k in truth) ** 0.5)
        assert err / scale < 1e-3, (mode, err / scale)  # float32 rounding; a wrong scale or clip is O(1)


def test_fast_sampler_handles_an_empty_poisson_batch_and_rejects_unsupported_layers():
    model = build_model("densenet_compact", 3, img_size=SIZE, norm="group", seed=0)
    sampler = FastGradSampler(model)
    optimizer = dp_optimizer_class()(
        torch.optim.SGD(model.parameters(), lr=0.1),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        expected_batch_size=2,
    )
    loss = PerSampleLoss(default_loss("multilabel"), "multilabel")
    optimizer.zero_grad()
    loss(model(torch.zeros(0, 1, SIZE, SIZE)), torch.zeros(0, 3)).backward()
    optimizer.pre_step()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    sampler.remove()
    assert all(p.requires_grad and not hasattr(p, "grad_sample") for p in model.parameters())
    vit = build_model("vit", 3, img_size=SIZE, seed=0)
    assert FastGradSampler.unsupported(vit)  # class token, position embeddings, LayerNorm
    with pytest.raises(ValueError, match="unsupported layers"):
        FastGradSampler(vit)


def test_fedprox_gradient_is_added_after_the_noise():
    """Same sampling and noise (fixed seed), one SGD step: theta(mu) - theta(0) = -lr mu (theta0 - theta_g)."""
    data = images(32)
    start = build_model("densenet_compact", 3, img_size=SIZE, norm="group", seed=0)
    theta0 = get_params(start)
    rng = np.random.default_rng(3)
    theta_g = {k: v + rng.normal(0, 0.1, v.shape).astype(v.dtype) for k, v in theta0.items()}
    lr, mu = 0.1, 0.5
    after = {}
    for m in (0.0, mu):
        model = copy.deepcopy(start)
        cfg = TrainConfig(batch_size=2, max_steps=1, lr=lr, optimizer="sgd", fedprox_mu=m)
        dp = DPSGD(DPConfig(noise_multiplier=1.0, mode="fast"), None, seed=11)
        result, report = dp.train_round(model, data, cfg, global_params=theta_g if m else None)
        assert result.num_steps == 1 and report.total_steps == 1
        after[m] = get_params(model)
    for k in theta0:
        np.testing.assert_allclose(
            after[mu][k] - after[0.0][k], -lr * mu * (theta0[k] - theta_g[k]), atol=1e-6
        )


@pytest.mark.parametrize("mode", ["fast", "hooks"])
def test_dp_sgd_noise_is_drawn_afresh_for_every_run_and_round(mode):
    """Without a seed (every NVFlare job) the noise comes from the OS, never from a value the server could
    know: two sites, or two rounds, starting from the same model on the same data get different noise.

    With the whole training set as the expected batch the Poisson rate is 1, so every step sees every
    sample and only the noise can make two runs differ (with one seed they are equal, checked first).
    """
    data = images(8)
    start = build_model("densenet_compact", 3, img_size=SIZE, norm="group", seed=0)
    cfg = TrainConfig(batch_size=len(data), max_steps=1, lr=0.1, optimizer="sgd")
    config = DPConfig(noise_multiplier=1.0, mode=mode)

    def one_round(dp: DPSGD) -> dict[str, np.ndarray]:
        model = copy.deepcopy(start)
        _, report = dp.train_round(model, data, cfg)
        assert report.sample_rate == 1.0 and report.steps == 1
        return get_params(model)

    def largest_difference(a: dict, b: dict) -> float:
        return max(float(np.max(np.abs(a[k] - b[k]))) for k in a if a[k].dtype.kind == "f")

    assert largest_difference(one_round(DPSGD(config, seed=5)), one_round(DPSGD(config, seed=5))) == 0.0
    site_a = DPSGD(config, site_name="site-a")
    first = one_round(site_a)
    # noise std on a weight: lr * sigma * C / batch = 0.1 * 1 * 1 / 8
    assert largest_difference(first, one_round(DPSGD(config, site_name="site-b"))) > 1e-3
    assert largest_difference(first, one_round(site_a)) > 1e-3  # the next round of the same site


# ------------------------------------------------------------------------------ Gaussian mechanism
def test_gaussian_noise_scales_match_the_formulas():
    sens = histogram_sensitivity(14, "multilabel")
    assert sens == math.sqrt(15) and histogram_sensitivity(5, "multiclass") == math.sqrt(2)
    classic = classic_gaussian_sigma(0.5, 1e-5, sens)
    assert classic == pytest.approx(math.sqrt(15) * math.sqrt(2 * math.log(1.25e5)) / 0.5)
    assert classic == pytest.approx(37.5277, abs=1e-3)
    for eps in (0.5, 1.0, 4.0):
        sigma = analytic_gaussian_sigma(eps, 1e-5, sens)
        # Balle and Wang's exact condition, evaluated here directly with scipy's normal CDF
        exact = norm.cdf(sens / (2 * sigma) - eps * sigma / sens) - math.exp(eps) * norm.cdf(
            -sens / (2 * sigma) - eps * sigma / sens
        )
        assert exact == pytest.approx(1e-5, rel=1e-6)
        assert gaussian_delta(sigma * 0.999, eps, sens) > 1e-5  # the smallest such sigma
        assert gaussian_sigma(eps, 1e-5, sens) == sigma
    assert analytic_gaussian_sigma(0.5, 1e-5, sens) < classic
    with pytest.raises(ValueError, match="epsilon < 1"):
        StatsDPConfig(epsilon=2.0, mechanism="classic")


def test_noised_histograms_are_consistent_and_unbiased():
    rng = np.random.default_rng(0)
    config = StatsDPConfig(epsilon=1.0, delta=1e-5)
    counts, n = np.array([500, 800, 300, 0, 1]), 2000
    draws = [privatize_histogram(counts, n, "multilabel", config, rng) for _ in range(4000)]
    sigma = draws[0].sigma
    assert sigma == analytic_gaussian_sigma(1.0, 1e-5, math.sqrt(6))
    released = np.array([d.class_counts for d in draws])
    sizes = np.array([d.num_samples for d in draws])
    assert released.dtype == np.int64 and (released >= 0).all() and (released <= sizes[:, None]).all()
    # unbiased where clipping cannot bite (counts >> sigma): |mean - true| < 5 standard errors
    se = sigma / math.sqrt(len(draws))
    assert np.all(np.abs(released[:, :3].mean(axis=0) - counts[:3]) < 5 * se)
    assert abs(sizes.mean() - n) < 5 * se
    assert np.std(released[:, 0]) == pytest.approx(sigma, rel=0.05)

    multiclass = privatize_histogram(np.array([40, 0, 25]), 65, "multiclass", config, rng)
    assert multiclass.sensitivity == math.sqrt(2)
    assert multiclass.num_samples == multiclass.class_counts.sum() and (multiclass.class_counts >= 0).all()


def test_statistics_noise_is_drawn_afresh_for_every_job_and_site(tmp_path):
    """The noise on a released histogram comes from the OS: two jobs, two sites, two direct draws of the
    same histogram differ (sigma ~ 18 here: equal releases have negligible probability)."""
    config = StatsDPConfig(epsilon=1.0, delta=1e-5)
    counts, n = np.array([30, 12, 0, 7, 25, 3, 9, 14, 1, 0, 5, 8, 2, 40]), 60
    releases = [
        HistogramReleaser(config, site, job, folder=tmp_path).release(counts, n, "multilabel")
        for site, job in (("site-1", "job-a"), ("site-1", "job-b"), ("site-2", "job-a"))
    ]
    releases += [privatize_histogram(counts, n, "multilabel", config) for _ in range(2)]
    vectors = {tuple(r.class_counts.tolist()) + (r.num_samples,) for r in releases}
    assert len(vectors) == len(releases)


def stats_trainer(job_id: str, **args) -> SimpleNamespace:
    """What the statistics task uses of a SiteTrainer: its histogram release and site, nothing else."""
    train = images(60, classes=14, seed=4)
    client_args = ClientArgs(**args)
    releaser = HistogramReleaser(client_args.stats_dp_config(), "site-2", job_id)
    class_counts = train.label_histogram()
    return SimpleNamespace(
        args=client_args,
        class_counts=class_counts,
        site=SimpleNamespace(train=train),
        num_train=len(train),
        job_id=job_id,
        site_name="site-2",
        global_stats=None,
        releaser=releaser,
        released_statistics=lambda: releaser.release(class_counts, len(train), train.task),
    )


def test_statistics_task_sends_the_noised_release_once_and_reports_the_budget(tmp_path, monkeypatch):
    from nvflare.app_common.abstract.fl_model import FLModel

    from fedweigh.flare.statistics import META_MODE, META_STEP, answer_statistics_task
    from fedweigh.histograms import META_EXCHANGE_ID, META_VECTOR, statistics_vector

    monkeypatch.chdir(tmp_path)
    collect = FLModel(
        params={}, meta={META_STEP: "collect", META_MODE: "plain", META_EXCHANGE_ID: "exchange-0123456789"}
    )

    plain = answer_statistics_task(stats_trainer("job-a"), collect)
    exact = statistics_vector(stats_trainer("job-a").class_counts, 60)
    assert (
        plain.meta[META_VECTOR] == pytest.approx(exact.tolist()) and "stats_dp_epsilon" not in plain.metrics
    )

    trainer = stats_trainer("job-b", stats_dp_epsilon=1.0, stats_dp_delta=1e-6)
    first = answer_statistics_task(trainer, collect)
    assert first.metrics["stats_dp_epsilon"] == 1.0 and first.metrics["stats_dp_delta"] == 1e-6
    vector = np.asarray(first.meta[META_VECTOR])
    release = trainer.releaser.drawn
    assert release.sigma == analytic_gaussian_sigma(1.0, 1e-6, math.sqrt(15))
    assert not np.array_equal(vector[:14], exact[:14])  # sigma ~ 18: equality has negligible probability
    # N_k c_k is derived from the noised counts (post-processing)
    np.testing.assert_allclose(vector, statistics_vector(release.class_counts, release.num_samples))
    # asked again, or by a relaunched client process: the same release, no second draw
    again = answer_statistics_task(trainer, collect)
    relaunched = answer_statistics_task(
        stats_trainer("job-b", stats_dp_epsilon=1.0, stats_dp_delta=1e-6), collect
    )
    assert again.meta[META_VECTOR] == first.meta[META_VECTOR] == relaunched.meta[META_VECTOR]


def test_scheme_scalars_derive_from_the_released_histogram(tmp_path, monkeypatch):
    from fedweigh.imbalance import client_imbalance

    monkeypatch.chdir(tmp_path)
    args = ClientArgs(size=SIZE, eval_test=False, stats_dp_epsilon=2.0)
    trainer = SiteTrainer(
        SiteData("site-3", images(40, classes=14, seed=5), images(4, classes=14)), images(4, 14), args
    )
    params = get_params(trainer.model)
    scalars = trainer.scheme_scalars({"scheme": "dafl", "scalars": ["imbalance"]}, params, params)
    released = trainer.released_statistics()
    counts, n = released.class_counts, released.num_samples
    assert trainer.releaser.drawn is not None and n == trainer.releaser.drawn.num_samples
    assert scalars["imbalance"] == pytest.approx(client_imbalance(counts, n))
    assert scalars["imbalance"] != pytest.approx(client_imbalance(trainer.class_counts, 40))
