"""The shared round loop (fedweigh.server.loop.run_rounds): what it sends, in which order it calls its
transport's hooks, what it records, when it ends early; and that the benchmark runs its rounds
through it (tests/test_controller_run.py checks the controller does)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import fedweigh.bench.modes as modes
import fedweigh.flare.controller as controller_module
from fedweigh.server import loop
from fedweigh.server.loop import LoopSettings, TrainTask, Transport, ValidateTask, run_rounds
from fedweigh.server.records import RoundRecorder
from fedweigh.server.rounds import ClientResult, PlaintextBackend, RoundStep
from fedweigh.server.safeguards import Safeguards
from fedweigh.weighting import get_scheme

SITES = {"site-1": 10, "site-2": 30, "site-3": 20}


class Params(dict):
    """A dict that a weak reference can follow (to see when the loop lets a round's results go)."""


class Recording(Transport):
    """Sites that add a fixed step to the model they receive; every call is recorded."""

    def __init__(self, stop_at: int | None = None, give_up_at: int | None = None):
        self.calls: list[tuple] = []
        self.tasks: list[TrainTask] = []
        self.results: list[weakref.ref] = []
        self.stop_at, self.give_up_at = stop_at, give_up_at

    def site_names(self) -> list[str]:
        return list(reversed(SITES))  # the loop must not depend on this order

    def train(self, task: TrainTask) -> list[ClientResult]:
        self.calls.append(("train", task.round_index, tuple(task.targets)))
        self.tasks.append(task)
        out = []
        for site in task.targets:
            params = Params(w=np.asarray(task.params["w"]) + SITES[site] / 100)
            self.results.append(weakref.ref(params))
            meta = {"num_samples": SITES[site], "NUM_STEPS_CURRENT_ROUND": 1}
            out.append(ClientResult(site, params, meta, {"val_auc": 0.5 + task.round_index / 10}))
        return out

    def validate(self, task: ValidateTask) -> list[dict]:
        self.calls.append(("validate", task.num_rounds, tuple(task.targets)))
        return [{"val_auc": 0.9}, {"val_auc": 0.7}]

    def stop_before(self, round_index: int) -> bool:
        return round_index == self.stop_at

    def round_started(self, round_index, backend) -> None:
        self.calls.append(("round_started", round_index))

    def before_aggregation(self, round_index: int) -> None:
        self.calls.append(("before_aggregation", round_index))

    def after_aggregation(self, round_index, outcome) -> bool:
        self.calls.append(("after_aggregation", round_index, outcome.updated))
        return round_index != self.give_up_at

    def free_memory(self, round_index: int) -> None:
        gc.collect()
        released = all(ref() is None for ref in self.results)
        self.calls.append(("free_memory", round_index, released))

    def global_metrics(self, params) -> dict[str, float]:
        self.calls.append(("global_metrics", float(np.asarray(params["w"])[0])))
        return {"test_auc": float(np.asarray(params["w"])[0])}

    def round_values(self) -> dict[str, float]:
        return {"server_mb": 1.0}

    def round_saved(self, round_index, backend, rows) -> None:
        self.calls.append(("round_saved", round_index, max(r["round"] for r in rows)))


def _run(transport: Recording, rounds: int = 2, **settings) -> tuple[bool, list[dict], RoundStep]:
    step = RoundStep(
        get_scheme("fedavg"),
        PlaintextBackend({"w": np.zeros(2)}),
        num_rounds=rounds,
        safeguards=Safeguards.off(),
    )
    recorder = RoundRecorder(None, "fedavg")
    plan = step.plan("fedavg", {})
    done = run_rounds(step, transport, recorder, plan, LoopSettings(**settings))
    return done, recorder.rows, step


def test_each_round_calls_the_hooks_in_the_controllers_order_and_records_the_rows():
    transport = Recording()
    done, rows, step = _run(transport)
    w1 = (10 * 0.1 + 30 * 0.3 + 20 * 0.2) / 60  # FedAvg of the sites' steps: sum N_k * d_k / N
    assert done
    assert transport.calls == [
        ("round_started", 1),
        ("train", 1, ("site-1", "site-2", "site-3")),  # sampled, in name order
        ("before_aggregation", 1),
        ("after_aggregation", 1, True),
        ("global_metrics", 0.0),  # theta_g^0, the model the sites received
        ("free_memory", 1, True),  # the round's client results are released by then
        ("round_saved", 1, 1),
        ("round_started", 2),
        ("train", 2, ("site-1", "site-2", "site-3")),
        ("before_aggregation", 2),
        ("after_aggregation", 2, True),
        ("global_metrics", pytest.approx(w1)),
        ("free_memory", 2, True),
        ("round_saved", 2, 2),
        ("validate", 2, ("site-1", "site-2", "site-3")),
        ("global_metrics", pytest.approx(2 * w1)),
    ]
    task = transport.tasks[0]
    assert (task.num_rounds, task.plan["scheme"], task.evaluate) == (2, "fedavg", True)
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert rows[0]["val_auc"] == pytest.approx(0.6) and rows[0]["test_auc"] == 0.0
    assert rows[1]["weights"] == pytest.approx({"site-1": 10 / 60, "site-2": 30 / 60, "site-3": 20 / 60})
    assert rows[1]["server_mb"] == 1.0 and rows[1]["round_seconds"] >= 0
    assert rows[2]["val_auc"] == pytest.approx(0.8) and rows[2]["test_auc"] == pytest.approx(2 * w1)
    np.testing.assert_allclose(step.backend.task_params()["w"], 2 * w1)


def test_partial_participation_samples_from_the_sites_taking_part():
    transport = Recording()
    _run(transport, rounds=3, sample_fraction=0.5, seed=4)
    trained = [c[2] for c in transport.calls if c[0] == "train"]
    expected = [tuple(loop.sample_sites(list(SITES), 0.5, 1, 4, t)) for t in (1, 2, 3)]
    assert trained == expected and all(len(t) == 2 for t in trained)
    assert len(set(trained)) > 1  # the sample changes by round


def test_eval_every_k_evaluates_rounds_one_k_plus_one_and_the_final_model():
    transport = Recording()
    _, rows, _ = _run(transport, rounds=3, eval_every=2)
    assert [t.evaluate for t in transport.tasks] == [True, False, True]
    assert [r["round"] for r in rows if "test_auc" in r] == [0, 2, 3]


def test_the_transport_can_end_the_run_before_a_round_or_after_one():
    stopped = Recording(stop_at=2)
    done, rows, _ = _run(stopped, rounds=3)
    assert not done
    assert [c[1] for c in stopped.calls if c[0] == "train"] == [1]
    assert not [c for c in stopped.calls if c[0] == "validate"]  # no final evaluation
    gave_up = Recording(give_up_at=1)
    done, rows, _ = _run(gave_up, rounds=3)
    assert not done and "round_saved" not in [c[0] for c in gave_up.calls]
    assert rows[1]["global_updated"] is True and "round_seconds" not in rows[1]  # recorded, not persisted
    assert not [c for c in gave_up.calls if c[0] in ("validate", "free_memory")]


def test_a_resumed_run_starts_at_its_first_round_and_the_final_task_can_be_left_out():
    transport = Recording()
    _run(transport, rounds=3, first_round=3, evaluate_final=False)
    assert [c[0] for c in transport.calls if c[0] in ("train", "validate")] == ["train"]
    assert transport.tasks[0].round_index == 3


def test_the_final_task_is_always_sent_under_he():
    class EncryptedLooking(PlaintextBackend):
        encrypted = True

    transport = Recording()
    step = RoundStep(get_scheme("fedavg"), EncryptedLooking({"w": np.zeros(2)}), num_rounds=1)
    settings = LoopSettings(first_round=2, evaluate_final=False)
    run_rounds(step, transport, RoundRecorder(None, "fedavg"), {}, settings)
    assert [c[0] for c in transport.calls] == ["validate", "global_metrics"]


def test_loop_settings_are_checked_once_by_their_rule():
    from fedweigh.errors import ConfigError

    with pytest.raises(ConfigError, match="sample_fraction = 0"):
        LoopSettings(sample_fraction=0.0)
    with pytest.raises(ConfigError, match="eval_every = 0"):
        LoopSettings(eval_every=0)


# ------------------------------------------------------------------------------------------ adapters
def test_the_adapters_import_the_loop_they_run():
    assert controller_module.run_rounds is loop.run_rounds
    assert modes.run_rounds is loop.run_rounds


def test_a_bench_cell_runs_its_rounds_through_the_shared_loop(monkeypatch):
    from fedweigh.bench import make_config, run_cell
    from fedweigh.bench.sites import InProcessSites

    calls = []

    def spy(step, transport, recorder, plan, settings=None, log=None):
        calls.append((type(transport), step.num_rounds, settings.eval_every))
        return loop.run_rounds(step, transport, recorder, plan, settings, log)

    monkeypatch.setattr(modes, "run_rounds", spy)
    config = make_config(
        "smoke",
        "synthcxr",
        methods=["fedavg"],
        scenarios=["iid-4"],
        rounds=2,
        num_images=80,
        max_steps=1,
        threads=1,
    )
    record, _, _ = run_cell(config, "iid-4", "fedavg", 0)
    assert calls == [(InProcessSites, 2, 1)]
    assert [r["round"] for r in record["rows"]] == [0, 1, 2]
