"""Label statistics that cannot be differenced, and sums bound to their job and exchange.

Differencing: two exchanges whose members differ by one site reveal that site's histogram exactly
when statistics travel exact; with the default site policy (statistics_epsilon 1.0) the difference
carries the Gaussian noise of the releases. Binding: a replayed, foreign or misstated sum, or one
site's ciphertext passed off as a sum of several, is refused at decode, naming why.
"""

from __future__ import annotations

import base64
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from nvflare.app_common.abstract.fl_model import FLModel

from fedweigh.data.base import LabeledImages, SiteData
from fedweigh.flare.keys import role_context_provider
from fedweigh.flare.statistics import META_STEP, answer_statistics_task, run_statistics_phase
from fedweigh.histograms import META_MEMBERS, META_NUM_CONTRIBUTIONS
from fedweigh.secure.exchange import META_CIPHERTEXT
from fedweigh.secure.gaussian import gaussian_sigma, histogram_sensitivity
from fedweigh.secure.stats_release import HistogramReleaser
from fedweigh.site.args import ClientArgs
from fedweigh.site.policy import PERMISSIVE_DEFAULT, PROVISIONED_DEFAULT, PrivacyGuard, PrivacyLedger
from fedweigh.site.trainer import SiteTrainer

torch.set_num_threads(1)

SITES = ("site-1", "site-2", "site-3", "site-4")
N = 2000
#: known histograms (5 findings), far from 0 and N so that clipping never bends the noise
COUNTS = {
    "site-1": np.array([600, 700, 800, 900, 1000]),
    "site-2": np.array([650, 720, 810, 930, 990]),
    "site-3": np.array([610, 760, 850, 905, 1020]),
    "site-4": np.array([633, 744, 866, 977, 1011]),
}
EXACT = replace(PERMISSIVE_DEFAULT, statistics_epsilon=None, source="test: exact statistics")


def stats_site(name: str, job_id: str, policy=PERMISSIVE_DEFAULT, args: ClientArgs | None = None):
    """A site as the statistics phase sees it, releasing by SiteTrainer's rule (the job's epsilon, else the
    policy's)."""
    args = args or ClientArgs()
    releaser = HistogramReleaser(args.stats_dp_config(policy.statistics_epsilon), name, job_id)
    return SimpleNamespace(
        site_name=name,
        job_id=job_id,
        global_stats=None,
        num_train=N,
        releaser=releaser,
        released_statistics=lambda: releaser.release(COUNTS[name], N, "multilabel"),
    )


class Controller:
    """The server side: every site answers through answer_statistics_task; ``tamper`` may rewrite the
    distribute step's meta (a server that replays or forges sums); what is distributed is kept."""

    def __init__(self, sites: dict, tamper=None):
        self.sites, self.tamper = sites, tamper
        self.collected: dict[str, dict] = {}
        self.distributed: dict | None = None
        self.answers: dict[str, dict] = {}
        self.warnings: list[str] = []

    def ask_sites(self, task_name, data, targets, min_responses):
        meta = dict(data.meta)
        if meta[META_STEP] == "distribute":
            meta = self.tamper(meta) if self.tamper else meta
            self.distributed = meta
        out = []
        for site in targets:
            answer = answer_statistics_task(self.sites[site], FLModel(params={}, meta=dict(meta)))
            answer.meta = {**(answer.meta or {}), "client_name": site}
            (self.collected if meta[META_STEP] == "collect" else self.answers)[site] = dict(answer.meta)
            out.append(answer)
        return out

    def info(self, msg):
        pass

    def warning(self, msg):
        self.warnings.append(msg)

    def fail_job(self, reason):
        raise AssertionError(reason)


def exchange(job_id: str, members, mode: str = "secure", policy=PERMISSIVE_DEFAULT, tamper=None):
    """One statistics phase of job ``job_id`` among ``members``; (the sites, the controller)."""
    sites = {s: stats_site(s, job_id, policy) for s in members}
    controller = Controller(sites, tamper)
    run_statistics_phase(controller, list(members), mode, floor=3)
    return sites, controller


def differenced(mode: str, policy, tag: str = "") -> np.ndarray:
    """Exchange 1 (sites 1-4) and exchange 2 (sites 1-3, site-4 offline) in two jobs: H1 - H2 as site-1
    decodes them."""
    first, _ = exchange(f"job-1{tag}", SITES, mode, policy)
    second, _ = exchange(f"job-2{tag}", SITES[:3], mode, policy)
    assert first["site-1"].global_stats is not None and second["site-1"].global_stats is not None
    return first["site-1"].global_stats.class_counts - second["site-1"].global_stats.class_counts


# ------------------------------------------------------------------------------------- (a) differencing
def test_exact_statistics_let_two_exchanges_reveal_the_missing_sites_histogram(sim_keys):
    """With statistics_epsilon None (exact), H1 - H2 is site-4's histogram, exactly."""
    np.testing.assert_array_equal(differenced("secure", EXACT), COUNTS["site-4"])


def test_the_default_policy_noises_the_difference_of_two_exchanges(sim_keys):
    """With the default policy H1 - H2 is not site-4's histogram: every release carries Gaussian noise."""
    diff = differenced("secure", PERMISSIVE_DEFAULT)
    assert not np.array_equal(diff, COUNTS["site-4"])
    assert PROVISIONED_DEFAULT.statistics_epsilon == PERMISSIVE_DEFAULT.statistics_epsilon == 1.0


def test_the_difference_has_the_spread_of_seven_releases(tmp_path, monkeypatch):
    """Over repeated jobs H1 - H2 - h_4 has the spread sqrt(7) sigma: site-4's noise and sites 1-3's noise
    of both jobs (plain exchanges, the same release code; sigma: epsilon 1.0, delta 1e-5, sensitivity
    sqrt(C + 1))."""
    monkeypatch.chdir(tmp_path)
    sigma = gaussian_sigma(1.0, 1e-5, histogram_sensitivity(5, "multilabel"), "analytic")
    errors = np.concatenate(
        [differenced("plain", PERMISSIVE_DEFAULT, f"-{r}") - COUNTS["site-4"] for r in range(40)]
    )
    spread = float(errors.std(ddof=1))
    assert abs(float(errors.mean())) < 4 * math.sqrt(7) * sigma / math.sqrt(errors.size)
    assert 0.8 * math.sqrt(7) * sigma < spread < 1.2 * math.sqrt(7) * sigma


# ------------------------------------------------------------------------------------------ (b)-(d) binding
def _refusals(controller: Controller) -> dict[str, str]:
    return {s: str(a.get("error")) for s, a in controller.answers.items() if not a.get("ok")}


def test_an_honest_exchange_is_decoded_by_every_site(sim_keys):
    sites, controller = exchange("job-1", SITES, policy=EXACT)
    assert not _refusals(controller) and set(controller.answers) == set(SITES)
    assert sites["site-2"].global_stats.class_counts.tolist() == sum(COUNTS.values()).tolist()


@pytest.mark.parametrize("keep_id", [False, True])
def test_a_replayed_sum_of_another_job_is_refused(sim_keys, keep_id):
    """The server hands out job 1's sum in job 2 (its exchange id, or the new one with the old ciphertext)."""
    _, old = exchange("job-1", SITES, policy=EXACT)
    stale = dict(old.distributed)

    def replay(meta):
        return (
            {**stale, "fedweigh_stats_exchange_id": meta["fedweigh_stats_exchange_id"]} if keep_id else stale
        )

    sites, controller = exchange("job-2", SITES, policy=EXACT, tamper=replay)
    refusals = _refusals(controller)
    assert set(refusals) == set(SITES), refusals
    assert all("the sum is not of this exchange (a stale or foreign sum)" in why for why in refusals.values())
    assert all(s.global_stats is None for s in sites.values())


def test_a_sum_of_an_earlier_exchange_of_the_same_job_is_refused(sim_keys):
    _, first = exchange("job-1", SITES, policy=EXACT)
    stale = first.distributed[META_CIPHERTEXT]
    sites, controller = exchange(
        "job-1", SITES, policy=EXACT, tamper=lambda meta: {**meta, META_CIPHERTEXT: stale}
    )
    assert all("a stale or foreign sum" in why for why in _refusals(controller).values())
    assert len(_refusals(controller)) == 4


def test_a_misstated_member_list_is_refused(sim_keys):
    """The server sums sites 1-3 and announces sites 1, 2 and 4."""
    sites, controller = exchange(
        "job-1",
        SITES[:3],
        policy=EXACT,
        tamper=lambda meta: {**meta, META_MEMBERS: ["site-1", "site-2", "site-4"]},
    )
    refusals = _refusals(controller)
    assert set(refusals) == set(SITES[:3])
    assert all("binding tags do not equal" in why and "site-4" in why for why in refusals.values())


def test_one_sites_ciphertext_passed_off_as_a_sum_of_three_is_refused(sim_keys):
    """The server returns site-1's ciphertext plus the plaintext count 2 as the sum of sites 1-3."""
    server_ctx = role_context_provider()("server")
    import tenseal as ts

    def forge(meta):
        one = controller.collected["site-1"][META_CIPHERTEXT]
        vec = ts.ckks_vector_from(server_ctx, base64.b64decode(one))
        vec = vec + ([0.0] * (vec.size() - 1) + [2.0])  # the count slot forged by adding a plaintext
        return {
            **meta,
            META_CIPHERTEXT: base64.b64encode(vec.serialize()).decode(),
            META_NUM_CONTRIBUTIONS: 3,
        }

    sites = {s: stats_site(s, "job-1", EXACT) for s in SITES[:3]}
    controller = Controller(sites, forge)
    run_statistics_phase(controller, list(SITES[:3]), "secure", floor=3)
    refusals = _refusals(controller)
    assert set(refusals) == set(SITES[:3]), refusals
    assert all("the sum is not of this exchange" in why for why in refusals.values())


def test_a_plain_sum_of_another_exchange_is_refused(tmp_path, monkeypatch):
    """Plain mode: bound by the exchange id only."""
    monkeypatch.chdir(tmp_path)
    _, old = exchange("job-1", SITES, "plain", EXACT)
    stale = dict(old.distributed)
    _, controller = exchange("job-2", SITES, "plain", EXACT, tamper=lambda meta: stale)
    refusals = _refusals(controller)
    assert len(refusals) == 4 and all("a stale or foreign sum" in why for why in refusals.values())


def test_a_collect_step_without_an_exchange_id_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    answer = answer_statistics_task(
        stats_site("site-1", "job-1", EXACT), FLModel(params={}, meta={META_STEP: "collect"})
    )
    assert "no valid exchange id" in answer.meta["fedweigh_refused"]
    assert "fedweigh_stats_vector" not in answer.meta


# ---------------------------------------------------------------------------------- (e), (f) the budget
class RecordingGuard(PrivacyGuard):
    """The real guard (policy, ledger), keeping what it was told to record."""

    def __init__(self, policy, tmp_path):
        super().__init__(policy, PrivacyLedger(tmp_path / "ledger.json"), "site-1", "job-1")
        self.recorded: list[tuple] = []

    def record(self, mechanism, epsilon, delta=None):
        self.recorded.append((mechanism, epsilon, delta))
        super().record(mechanism, epsilon, delta)


def trainer(args: ClientArgs, guard) -> SiteTrainer:
    rng = np.random.default_rng(0)
    x = rng.random((24, 1, 16, 16), dtype=np.float32)
    train = LabeledImages(x, (rng.random((24, 3)) < 0.4).astype(np.float32), ("a", "b", "c"), "multilabel")
    return SiteTrainer(SiteData("site-1", train, train), train, args, job_id="job-1", privacy_guard=guard)


def test_the_default_statistics_epsilon_is_spent_in_the_ledger(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    guard = RecordingGuard(PROVISIONED_DEFAULT, tmp_path)
    site = trainer(ClientArgs(size=16, eval_test=False), guard)
    release = site.released_statistics()
    assert (release.epsilon, release.delta) == (1.0, 1e-5)
    assert guard.recorded == [("statistics", 1.0, 1e-5)]


def test_a_jobs_stats_dp_epsilon_wins_over_the_policy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    guard = RecordingGuard(PROVISIONED_DEFAULT, tmp_path)
    site = trainer(ClientArgs(size=16, eval_test=False, stats_dp_epsilon=0.5, stats_dp_delta=1e-6), guard)
    assert site.released_statistics().epsilon == 0.5
    assert guard.recorded == [("statistics", 0.5, 1e-6)]
    exact = trainer(ClientArgs(size=16, eval_test=False), RecordingGuard(EXACT, tmp_path / "x"))
    assert exact.released_statistics().epsilon is None  # statistics_epsilon None: exact, nothing spent


def test_model_only_scalars_release_no_statistics_and_spend_no_budget(tmp_path, monkeypatch):
    """FedDRAW's similarity reports nothing of the histogram: no release is drawn for it; CBR's skew is."""
    monkeypatch.chdir(tmp_path)
    guard = RecordingGuard(PROVISIONED_DEFAULT, tmp_path)
    site = trainer(ClientArgs(size=16, eval_test=False), guard)
    params = {k: v.detach().numpy() for k, v in site.model.state_dict().items()}
    site.scheme_scalars({"scheme": "feddraw", "scalars": ["similarity"]}, params, params)
    assert guard.recorded == [] and site.releaser.drawn is None
    site.scheme_scalars({"scheme": "cbr", "scalars": ["skew"]}, params, params)
    assert guard.recorded == [("statistics", 1.0, 1e-5)] and site.releaser.drawn is not None


# ---------------------------------------------------------------------------------------- the benchmark
def test_the_bench_releases_by_the_simulation_policy_unless_asked_for_exact_statistics():
    from fedweigh.bench.cells import settings_hash
    from fedweigh.bench.cli import _bench_config
    from fedweigh.bench.config import make_config
    from fedweigh.cli import build_parser

    default = make_config("smoke", "synthcxr")
    exact = make_config("smoke", "synthcxr", exact_statistics=True)
    assert default.statistics_epsilon() == 1.0 and default.site_policy() is PERMISSIVE_DEFAULT
    assert exact.statistics_epsilon() is None and exact.site_policy().statistics_epsilon is None
    assert make_config("smoke", "synthcxr", stats_dp_epsilon=0.5).statistics_epsilon() == 0.5
    # cells stored with exact statistics keep their digest; the default's cells get their own
    assert settings_hash(default, "iid-4", "fedbb", 0) != settings_hash(exact, "iid-4", "fedbb", 0)
    args = build_parser().parse_args(["bench", "--exact-statistics", "--out", "x"])
    assert _bench_config(args).exact_statistics is True
    assert _bench_config(build_parser().parse_args(["bench", "--out", "x"])).exact_statistics is False


def test_the_bench_sites_draw_the_default_release_reproducibly():
    """The bench's sites (LocalSites) noise by the simulation policy, drawn from the cell's seed."""
    from fedweigh.bench.sites import LocalSites

    rng = np.random.default_rng(0)
    x = rng.random((24, 1, 16, 16), dtype=np.float32)
    train = LabeledImages(x, (rng.random((24, 3)) < 0.4).astype(np.float32), ("a", "b", "c"), "multilabel")
    sites = [SiteData(f"site-{k}", train, train) for k in (1, 2)]
    args = ClientArgs(size=16, eval_test=False, seed=3)
    first = LocalSites(sites, train, args, threads=1).released_statistics()
    again = LocalSites(sites, train, args, threads=1).released_statistics()
    assert all(r.epsilon == 1.0 for r in first.values())
    for name in first:
        np.testing.assert_array_equal(first[name].class_counts, again[name].class_counts)
    assert not np.array_equal(first["site-1"].class_counts, first["site-2"].class_counts)  # per site
    exact = LocalSites(sites, train, args, threads=1, policy=EXACT).released_statistics()
    np.testing.assert_array_equal(exact["site-1"].class_counts, train.label_histogram())


def test_privacy_md_quotes_the_sigma_of_the_tested_release():
    """docs/privacy.md's sigma for 5 findings at the default epsilon and delta is the release's own."""
    from pathlib import Path

    sigma = gaussian_sigma(1.0, 1e-5, histogram_sensitivity(5, "multilabel"), "analytic")
    page = " ".join((Path(__file__).resolve().parents[1] / "docs" / "privacy.md").read_text().split())
    assert f"(sigma {sigma:.1f} counts for 5 findings at epsilon 1, delta 1e-5)" in page
