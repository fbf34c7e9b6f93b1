"""FedweighController.run() in this process, with NVFlare's transport replaced by in-process sites.

Only ``broadcast_model`` (NVFlare's send-and-wait), the persistor calls and the engine are stood in for;
everything else is the controller as NVFlare runs it. The sites "train" by adding a fixed,
site- and round-specific update to the model they receive, so every global model can be computed by
hand and the tests see which task each site got, with which model and with which timeout.
"""

from __future__ import annotations

import gc
import json
import logging
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel

import fedweigh.flare.controller as controller_module
from fedweigh.flare.controller import FedweighController
from fedweigh.flare.statistics import META_STEP, answer_statistics_task
from fedweigh.protocol import (
    META_NUM_SAMPLES,
    META_NUM_STEPS,
    STATE_JSON,
    TASK_STATS,
    TASK_TRAIN,
    TASK_VALIDATE,
)
from fedweigh.weighting import get_scheme

SITES = {"site-1": 40, "site-2": 25, "site-3": 60}  # name -> N_k
INITIAL = {"w": np.zeros(6), "b": np.full(2, 0.5)}


def site_update(site: str, round_index: int) -> dict[str, np.ndarray]:
    """The fixed update a site's training adds in a round (differs by site and by round)."""
    rng = np.random.default_rng(1000 * int(site.split("-")[1]) + round_index)
    return {k: rng.normal(0.0, 0.1, v.shape) for k, v in INITIAL.items()}


@dataclass
class Sent:
    """One task as the controller sent it."""

    task: str
    step: str | None
    targets: list[str]
    timeout: int
    min_responses: int | None
    wait_after_min: int
    current_round: int | None  # NVFlare's, from 0
    params: dict


@dataclass
class InProcessFederation:
    """The sites of an in-process run and what they were sent."""

    sites: dict[str, int]
    silent: set = field(default_factory=set)  # (site, task) pairs that never answer
    reverse: bool = False  # answers arrive in reverse site order
    sent: list[Sent] = field(default_factory=list)
    trained: list[tuple[str, int]] = field(default_factory=list)  # (site, round index from 1)
    results: list[weakref.ref] = field(default_factory=list)  # every result handed to the controller

    def answer(self, site: str, task: str, data: FLModel) -> FLModel | None:
        if (site, task) in self.silent:
            return None
        n = self.sites[site]
        if task == TASK_TRAIN:
            t = int(data.current_round) + 1
            self.trained.append((site, t))
            params = {k: np.asarray(v) + site_update(site, t)[k] for k, v in data.params.items()}
            meta = {META_NUM_SAMPLES: n, META_NUM_STEPS: 3, "fedweigh_scalars": {}}
            return FLModel(params=params, meta=meta, metrics={"val_auc": 0.5 + t / 100})
        if task == TASK_STATS:
            counts = np.arange(1, 4) * n // 10
            trainer = SimpleNamespace(
                num_train=n,
                site_name=site,
                job_id="job",
                global_stats=None,
                released_statistics=lambda: SimpleNamespace(class_counts=counts, num_samples=n, epsilon=None),
            )
            return answer_statistics_task(trainer, data)
        return FLModel(metrics={"val_auc": 0.75, "val_gm": n / 30}, meta={META_NUM_SAMPLES: n})


def make_controller(fed: InProcessFederation, app_dir: Path, **options) -> FedweighController:
    """The controller with stand-in sites; the scheme alone decides the weights (no weight cap, no
    update-norm bound, no direction filter unless a test asks: those are tests/test_robust_rounds.py)."""
    robust_off = {"max_share": None, "update_norm_bound": None, "min_update_cosine": None}
    controller = FedweighController(min_clients=2, **{**robust_off, **options})
    controller.engine = SimpleNamespace(
        get_clients=lambda: [SimpleNamespace(name=s) for s in fed.sites],
        fire_event=lambda event_type, fl_ctx: None,
    )
    controller.fl_ctx = FLContext()
    controller.fl_ctx.set_prop(ReservedKey.ENGINE, controller.engine, private=True, sticky=True)
    controller.abort_signal = Signal()
    controller.get_app_dir = lambda: str(app_dir)
    controller.load_model = lambda: FLModel(params={k: v.copy() for k, v in INITIAL.items()})
    controller.saved = []
    controller.save_model = lambda model: controller.saved.append(model)

    def broadcast_model(
        data, task_name="train", targets=None, min_responses=None, timeout=0, wait_time_after_min_received=0
    ):
        targets = list(targets or fed.sites)
        fed.sent.append(
            Sent(
                task_name,
                (data.meta or {}).get(META_STEP),
                targets,
                timeout,
                min_responses,
                wait_time_after_min_received,
                data.current_round,
                {k: np.array(v) for k, v in (data.params or {}).items()},
            )
        )
        results = []
        for site in reversed(targets) if fed.reverse else targets:
            result = fed.answer(site, task_name, data)
            if result is not None:
                result.meta = {**(result.meta or {}), "client_name": site}
                results.append(result)
                fed.results.append(weakref.ref(result))
        return results

    controller.broadcast_model = broadcast_model
    return controller


def by_hand(scheme_name: str, rounds: int) -> tuple[dict, list[dict]]:
    """The global model and weights per round, from the scheme and the sites' fixed updates."""
    scheme = get_scheme(scheme_name)
    g = {k: v.copy() for k, v in INITIAL.items()}
    weights = []
    for t in range(1, rounds + 1):
        reports = _reports(g, t)
        w = np.asarray(scheme.weights(reports, g, t, rounds))
        g = {k: np.asarray(v) for k, v in scheme.aggregate(g, reports, w).items()}
        weights.append({r.name: float(x) for r, x in zip(reports, w, strict=True)})
    return g, weights


def rows_of(app_dir: Path) -> dict[int, dict]:
    return {r["round"]: r for r in json.loads((app_dir / "fedweigh_metrics.json").read_text())["rounds"]}


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the statistics task keeps its global statistics in the working folder


# ------------------------------------------------------------------------------------- timeouts
@pytest.mark.parametrize("statistics", ["plain", "secure"])
def test_train_timeout_applies_to_every_task(tmp_path, statistics, monkeypatch):
    """Statistics (collect, distribute), every training round and the final validation wait at most
    train_timeout; a site silent in one of them is left out of that task only."""
    if statistics == "secure":
        from fedweigh.secure.contexts import CONTEXT_DIR_ENV, save_context_files

        save_context_files(tmp_path / "keys")
        monkeypatch.setenv(CONTEXT_DIR_ENV, str(tmp_path / "keys"))
    fed = InProcessFederation(SITES, silent={("site-2", TASK_VALIDATE)})
    controller = make_controller(
        fed, tmp_path, num_rounds=2, statistics=statistics, loss_needs_global_stats=True, train_timeout=17
    )
    controller.run()
    tasks = [(s.task, s.step, s.current_round) for s in fed.sent]
    assert tasks == [
        (TASK_STATS, "collect", None),
        (TASK_STATS, "distribute", None),
        (TASK_TRAIN, None, 0),
        (TASK_TRAIN, None, 1),
        (TASK_VALIDATE, None, 2),
    ]
    for s in fed.sent:
        assert (s.timeout, s.wait_after_min) == (17, 17), s.task
        assert s.min_responses is not None and s.min_responses >= 1
    rows = rows_of(tmp_path)
    assert rows[2]["val_auc"] == 0.75  # the final validation of the two sites that answered
    assert Path("fedweigh_global_stats_job.json").is_file()


def test_without_train_timeout_every_task_waits_for_every_site(tmp_path):
    fed = InProcessFederation(SITES)
    make_controller(
        fed, tmp_path, num_rounds=1, statistics="plain", loss_needs_global_stats=True, train_timeout=0
    ).run()
    assert [s.task for s in fed.sent] == [TASK_STATS, TASK_STATS, TASK_TRAIN, TASK_VALIDATE]
    for s in fed.sent:
        assert (s.timeout, s.min_responses, s.wait_after_min) == (0, None, 0)
        assert s.targets == sorted(SITES)


def test_plain_statistics_warn_and_secure_ones_do_not(tmp_path, monkeypatch, caplog):
    from fedweigh.secure.contexts import CONTEXT_DIR_ENV, save_context_files

    save_context_files(tmp_path / "keys")
    monkeypatch.setenv(CONTEXT_DIR_ENV, str(tmp_path / "keys"))
    warnings = {}
    for mode in ("plain", "secure"):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            make_controller(
                InProcessFederation(SITES),
                tmp_path / mode,
                num_rounds=1,
                statistics=mode,
                loss_needs_global_stats=True,
            ).run()
        warnings[mode] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("travel in clear" in m and "label histogram" in m for m in warnings["plain"])
    assert not any("travel in clear" in m for m in warnings["secure"])


# ------------------------------------------------------------------------------------- memory
@pytest.mark.parametrize(("every", "rounds_freed"), [(1, [1, 2, 3, 4]), (2, [2, 4]), (0, [])])
def test_memory_gc_rounds_frees_memory_in_those_rounds(tmp_path, monkeypatch, every, rounds_freed):
    """The round's client results are released before the memory is returned to the system."""
    fed = InProcessFederation(SITES)
    freed = []

    def cleanup_memory():
        gc.collect()
        assert fed.results and all(ref() is None for ref in fed.results), "client results still referenced"
        freed.append(len(fed.trained) // len(SITES))

    monkeypatch.setattr(controller_module, "cleanup_memory", cleanup_memory)
    make_controller(fed, tmp_path, num_rounds=4, memory_gc_rounds=every).run()
    assert freed == rounds_freed


# ------------------------------------------------------------------------------------- the rounds
def test_the_controller_runs_its_rounds_through_the_shared_loop(tmp_path, monkeypatch):
    """FedweighController.run hands its rounds to fedweigh.server.loop.run_rounds with its NVFlare
    transport (the loop the benchmark runs; tests/test_loop.py checks the loop itself)."""
    from fedweigh.server import loop

    calls = []

    def spy(step, transport, recorder, plan, settings=None, log=None):
        calls.append((type(transport), step.num_rounds, settings.first_round, plan["budget_id"]))
        return loop.run_rounds(step, transport, recorder, plan, settings, log)

    monkeypatch.setattr(controller_module, "run_rounds", spy)
    fed = InProcessFederation(SITES)
    make_controller(fed, tmp_path, num_rounds=2).run()
    assert calls == [(controller_module.NVFlareTasks, 2, 1, "job")]
    assert [s.task for s in fed.sent] == [TASK_TRAIN, TASK_TRAIN, TASK_VALIDATE]
    assert sorted(rows_of(tmp_path)) == [0, 1, 2]


def test_rounds_aggregate_the_sites_updates_with_the_schemes_weights(tmp_path):
    fed = InProcessFederation(SITES)
    controller = make_controller(fed, tmp_path, num_rounds=3, scheme="fedadp")
    controller.run()
    expected, weights = by_hand("fedadp", 3)
    final = controller.saved[-1].params
    for k in expected:
        np.testing.assert_allclose(final[k], expected[k], rtol=0, atol=1e-12)
    rows = rows_of(tmp_path)
    for t in (1, 2, 3):
        assert rows[t]["weights"] == pytest.approx(weights[t - 1], abs=1e-12)
    assert [s.current_round for s in fed.sent if s.task == TASK_TRAIN] == [0, 1, 2]


# ------------------------------------------------------------------------------------- stop and resume
def test_resume_trains_only_the_remaining_rounds_from_the_saved_state(tmp_path):
    """FedAdp keeps smoothed angles across rounds: a run stopped after round 2 and resumed must restore
    them, the global model and the rows, and train round 3 only, from the saved model."""
    expected, weights = by_hand("fedadp", 3)

    first = InProcessFederation(SITES)
    part1 = make_controller(first, tmp_path / "part1", num_rounds=3, scheme="fedadp", stop_after=2)
    part1.run()
    assert sorted({t for _, t in first.trained}) == [1, 2]
    assert not [s for s in first.sent if s.task == TASK_VALIDATE]  # stopped: no final validation
    state = json.loads((tmp_path / "part1" / STATE_JSON).read_text())
    assert state["round"] == 2 and set(state["scheme_state"]["smoothed_angle"]) == set(SITES)
    after_two = part1.saved[-1].params

    second = InProcessFederation(SITES)
    part2 = make_controller(
        second, tmp_path / "part2", num_rounds=3, scheme="fedadp", resume_from=str(tmp_path / "part1")
    )
    part2.run()
    # only round 3 was trained, starting from the model saved after round 2
    assert sorted(second.trained) == [(s, 3) for s in sorted(SITES)]
    train_tasks = [s for s in second.sent if s.task == TASK_TRAIN]
    assert [s.current_round for s in train_tasks] == [2]
    for k in after_two:
        np.testing.assert_array_equal(train_tasks[0].params[k], after_two[k])
    # the weights of round 3 use the smoothed angles of rounds 1-2 (a fresh FedAdp state gives others)
    rows = rows_of(tmp_path / "part2")
    assert sorted(rows) == [0, 1, 2, 3]
    assert rows[3]["weights"] == pytest.approx(weights[2], abs=1e-12)
    fresh_w = get_scheme("fedadp").weights(_reports(after_two, 3), after_two, 3, 3)
    assert max(abs(a - b) for a, b in zip(fresh_w, weights[2].values(), strict=True)) > 1e-3
    final = part2.saved[-1].params
    for k in expected:
        np.testing.assert_allclose(final[k], expected[k], rtol=0, atol=1e-12)
    assert rows[1] == rows_of(tmp_path / "part1")[1]  # the earlier rows are carried over


def _reports(g: dict, t: int) -> list:
    from fedweigh.weighting.base import ClientReport

    return [
        ClientReport(name=s, num_samples=n, num_steps=3, params={k: g[k] + site_update(s, t)[k] for k in g})
        for s, n in SITES.items()
    ]


def test_resume_refuses_another_schemes_state(tmp_path):
    make_controller(InProcessFederation(SITES), tmp_path / "a", num_rounds=2, stop_after=1).run()
    other = make_controller(
        InProcessFederation(SITES),
        tmp_path / "b",
        num_rounds=2,
        scheme="fedadp",
        resume_from=str(tmp_path / "a"),
    )
    with pytest.raises(ValueError, match="state is for scheme 'fedavg'"):
        other.run()


def test_records_do_not_depend_on_the_order_in_which_results_arrive(tmp_path):
    """Every round and the final validation take the sites' results in site order (float sums of three
    sites depend on their order)."""
    rows = {}
    for reverse in (False, True):
        fed = InProcessFederation(SITES, reverse=reverse)
        make_controller(fed, tmp_path / str(reverse), num_rounds=2, scheme="fedadp").run()
        rows[reverse] = rows_of(tmp_path / str(reverse))
    assert 40 / 30 + 25 / 30 + 60 / 30 != 60 / 30 + 25 / 30 + 40 / 30  # the final val_gm sums these
    for t in (0, 1, 2):
        strip = ("round_seconds", "server_rss_mb", "server_peak_rss_mb")
        a, b = ({k: v for k, v in r[t].items() if k not in strip} for r in (rows[False], rows[True]))
        assert a == b, t
