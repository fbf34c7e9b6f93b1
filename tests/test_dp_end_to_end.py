"""DP done end to end: budgets keyed by an id that survives resume_from, nothing derived from the
training data in clear under DP-SGD, the loss built from the privatised statistics, noise from the
operating system, and only the scalars the plan asks for."""

from __future__ import annotations

import numpy as np
import pytest
from test_privacy import SIZE, images, site_data

from fedweigh.site.args import ClientArgs
from fedweigh.site.policy import PrivacyGuard, PrivacyLedger, SitePolicy
from fedweigh.site.trainer import SiteTrainer
from fedweigh.train import get_params


def dp_args(**overrides) -> ClientArgs:
    base = {"size": SIZE, "batch_size": 2, "max_steps": 2, "eval_test": False, "dp_epsilon": 3.0}
    return ClientArgs(**{**base, **overrides})


def test_the_budget_id_survives_resume_from(tmp_path):
    """The server keeps the budget id in its run state; a resumed run announces the same one."""
    from fedweigh.flare.controller import FedweighController
    from fedweigh.server.rounds import PlaintextBackend

    first = FedweighController(num_rounds=4)
    first._budget_id = "job-1"
    first._save_state(tmp_path, 2, PlaintextBackend({"w": np.zeros(2)}), [])
    resumed = FedweighController(num_rounds=4, resume_from=str(tmp_path))
    resumed._budget_id = "job-7"  # its own NVFlare job id, until the state is read
    resumed._load_state(str(tmp_path))
    assert resumed._budget_id == "job-1"


def test_a_resumed_job_continues_the_sites_epsilon(tmp_path, monkeypatch):
    """The site keys its DP-SGD account by the announced budget id, not by the NVFlare job id."""
    from fedweigh.flare.client import follow_budget

    monkeypatch.chdir(tmp_path)
    site, test = site_data(128), images(4, seed=2)
    spent = []
    for job_id, rounds in (("job-1", (0, 1)), ("job-2", (2,))):  # job-2 resumes job-1 after round 2
        guard = PrivacyGuard(
            SitePolicy(max_epsilon_total=None), PrivacyLedger("ledger.json"), "site-1", job_id
        )
        trainer = SiteTrainer(site, test, dp_args(), job_id=job_id, privacy_guard=guard)
        assert follow_budget(trainer, guard, {"budget_id": "job-1"}, job_id) == "job-1"
        params = get_params(trainer.model)
        for r in rounds:
            out = trainer.run_round(params, r, {}, total_rounds=4)
            params = out.params
            spent.append(out.metrics["dp_epsilon"])
    assert spent[0] < spent[1] < spent[2]  # round 3 continues the account instead of starting at zero
    ledger = PrivacyLedger("ledger.json")
    assert ledger.entries == {"job-1": {"dp_sgd": spent[2]}}
    # without a budget id in the plan the job's own id is used
    trainer = SiteTrainer(site, test, dp_args(), job_id="job-9")
    guard = PrivacyGuard(SitePolicy(), PrivacyLedger(), "site-1", "job-9")
    assert follow_budget(trainer, guard, {}, "job-9") == "job-9" and trainer.job_id == "job-9"


def test_train_loss_stays_at_the_site_under_dp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    site, test = site_data(32), images(4, seed=2)
    plain = SiteTrainer(site, test, dp_args(dp_epsilon=None))
    assert "train_loss" in plain.run_round(get_params(plain.model), 0, {}, total_rounds=2).metrics
    private = SiteTrainer(site, test, dp_args())
    metrics = private.run_round(get_params(private.model), 0, {}, total_rounds=2).metrics
    assert "train_loss" not in metrics and "dp_epsilon" in metrics
    assert all(k.startswith(("val_", "dp_")) for k in metrics), metrics


def test_under_dp_the_loss_is_built_from_the_privatised_statistics(tmp_path, monkeypatch):
    import fedweigh.site.trainer as site_module

    monkeypatch.chdir(tmp_path)
    seen = {}

    def capture(name, ctx, **options):
        seen["ctx"] = ctx
        return None

    monkeypatch.setattr(site_module, "build_loss", capture)
    site, test = site_data(64), images(4, seed=2)
    trainer = SiteTrainer(site, test, dp_args(loss="pnb", stats_dp_epsilon=0.5))
    trainer.make_loss()
    release = trainer.released_statistics()
    np.testing.assert_array_equal(seen["ctx"].class_counts, release.class_counts)
    assert seen["ctx"].num_samples == release.num_samples
    assert not np.array_equal(release.class_counts, trainer.class_counts)  # sigma ~ 27 counts at epsilon 0.5
    # without DP-SGD the site's own loss keeps its exact histogram
    exact = SiteTrainer(site, test, dp_args(dp_epsilon=None, loss="pnb", stats_dp_epsilon=0.5))
    exact.make_loss()
    np.testing.assert_array_equal(seen["ctx"].class_counts, exact.class_counts)


def test_dp_sgd_with_a_histogram_loss_needs_statistics_dp():
    with pytest.raises(ValueError, match="under DP-SGD it may only use the privatised histogram"):
        ClientArgs(dp_epsilon=3.0, loss="dafl")
    ClientArgs(dp_epsilon=3.0, loss="dafl", stats_dp_epsilon=1.0)
    ClientArgs(dp_epsilon=3.0)  # the default BCE / CE uses no statistics


def _two_identical_sites(tmp_path, monkeypatch, **args):
    """Two sites with the same data, arguments, seed and job id (in separate folders, so that no file
    is shared): everything the server knows about them is identical."""
    out = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir(parents=True)
        monkeypatch.chdir(folder)
        trainer = SiteTrainer(site_data(64), images(4, seed=2), dp_args(**args), job_id="job-1")
        trainer.released_statistics()  # drawn (and kept) in this site's own folder
        out.append((trainer, trainer.run_round(get_params(trainer.model), 0, {}, total_rounds=2)))
    return out


def test_dp_noise_comes_from_the_operating_system(tmp_path, monkeypatch):
    (a, out_a), (b, out_b) = _two_identical_sites(tmp_path / "os", monkeypatch, stats_dp_epsilon=1.0)
    # seeded from the job (its seed, id or round), the two would be identical: the server could
    # regenerate the noise and subtract it
    assert any(not np.array_equal(out_a.params[k], out_b.params[k]) for k in out_a.params)
    assert not np.array_equal(a.released_statistics().class_counts, b.released_statistics().class_counts)

    import fedweigh.secure.dp_sgd as dp_sgd
    import fedweigh.secure.gaussian as gaussian

    class FixedOS:  # the only randomness left: the operating system's, here made constant
        @staticmethod
        def randbits(k):
            return 12345

    monkeypatch.setattr(dp_sgd, "secrets", FixedOS)
    monkeypatch.setattr(gaussian, "secrets", FixedOS)
    (a, out_a), (b, out_b) = _two_identical_sites(tmp_path / "fixed", monkeypatch, stats_dp_epsilon=1.0)
    assert all(np.array_equal(out_a.params[k], out_b.params[k]) for k in out_a.params)
    assert np.array_equal(a.released_statistics().class_counts, b.released_statistics().class_counts)


def test_the_site_sends_only_the_scalars_the_plan_asks_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    site, test = site_data(32), images(4, seed=2)
    trainer = SiteTrainer(site, test, dp_args(dp_epsilon=None, stats_dp_epsilon=1.0))
    g = get_params(trainer.model)
    assert trainer.scheme_scalars({"scheme": "dafl", "scalars": []}, g, g) == {}
    assert trainer.releaser.drawn is None  # nothing asked: no statistics released, no budget spent
    assert set(
        trainer.scheme_scalars(
            {"scheme": "dafl", "scheme_args": {"mode": "inverse_imbalance"}, "scalars": ["imbalance"]}, g, g
        )
    ) == {"imbalance"}
    out = trainer.run_round(g, 0, {"scheme": "cbr", "scalars": ["skew"]}, total_rounds=2)
    assert set(out.scalars) == {"skew"}
    out = trainer.run_round(out.params, 1, {"scheme": "feddraw", "scalars": []}, total_rounds=2)
    assert out.scalars == {}
