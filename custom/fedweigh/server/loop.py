"""The server's run, in one place: T rounds of sample, send, collect, step and record, then a final
evaluation.

Both ways fedweigh runs a federation call :func:`run_rounds`: the NVFlare controller, whose transport
is NVFlare tasks (:class:`fedweigh.flare.controller.NVFlareTasks`), and the benchmark, whose sites
train in its own processes (:class:`fedweigh.bench.sites.InProcessSites`). Per round t:

1. the transport may end the run before the round (``stop_after``, an abort signal);
2. sample the sites: max(min_clients, ceil(fraction * K)) of the K sites taking part
   (:func:`sample_sites`, deterministic per seed and round);
3. send them theta_g^{t-1} with the scheme's plan (:class:`TrainTask`) and collect their results;
4. :meth:`RoundStep.run <fedweigh.server.rounds.RoundStep.run>`: validate, bound, weigh, cap and
   aggregate them into theta_g^t;
5. record the outcome (:meth:`RoundRecorder.add_outcome <fedweigh.server.records.RoundRecorder.add_outcome>`):
   the sites' mean metrics on theta_g^{t-1} as row t - 1, the weights and the scheme's values as row t.

After round T every site taking part evaluates theta_g^T (row T); under HE this task is always sent,
since it delivers theta_g^T to the sites. What a transport adds around a round (NVFlare's round
events, persisting the model and the run state, freeing memory; the benchmark's scores on the global
test set) are the hooks of :class:`Transport`.
"""

from __future__ import annotations

import logging
import math
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedweigh.arrays import Params
from fedweigh.checks import check_server_values
from fedweigh.server.records import RoundRecorder
from fedweigh.server.rounds import AggregationBackend, ClientResult, RoundOutcome, RoundStep, mean_metrics

__all__ = ["LoopSettings", "Transport", "TrainTask", "ValidateTask", "run_rounds", "sample_sites"]

logger = logging.getLogger("fedweigh.server.loop")


def sample_sites(
    all_sites: Sequence[str], fraction: float, min_clients: int, seed: int, round_index: int
) -> list[str]:
    """Deterministic per-round sample of max(min_clients, ceil(fraction * K)) sites, in name order."""
    sites = sorted(all_sites)
    k = min(len(sites), max(min_clients, math.ceil(fraction * len(sites))))
    if k >= len(sites):
        return sites
    rng = random.Random(seed * 7_919 + round_index)
    return sorted(rng.sample(sites, k))


@dataclass(frozen=True)
class LoopSettings:
    """How :func:`run_rounds` runs (``min_clients`` and T are the round step's).

    Args:
        sample_fraction: fraction of the sites sampled per round.
        seed: seed of the sampling.
        first_round: the first round to run (after a resumed run's last one).
        eval_every: the sites evaluate the model they receive, and the transport's
            :meth:`~Transport.global_metrics` are recorded, in rounds 1, 1 + k, 1 + 2k, ... (rows 0,
            k, 2k, ...; row T always). Training is the same for every k.
        evaluate_final: send theta_g^T to every site after the last round (always under HE).
    """

    sample_fraction: float = 1.0
    seed: int = 0
    first_round: int = 1
    eval_every: int = 1
    evaluate_final: bool = True

    def __post_init__(self) -> None:
        check_server_values(
            {"sample_fraction": self.sample_fraction, "eval_every": self.eval_every}, "round loop"
        )

    def scored(self, round_index: int) -> bool:
        """Whether the model sent in round t (row t - 1) is evaluated: rounds 1, 1 + k, ..."""
        return (round_index - 1) % self.eval_every == 0


@dataclass(frozen=True)
class TrainTask:
    """What the sampled sites receive in round t (from 1): theta_g^{t-1} as the backend sends it, the
    scheme's plan, the meta the sites need to read the model (under HE: its layout), and whether
    they evaluate the model they receive before training on it."""

    round_index: int
    num_rounds: int
    targets: list[str]
    params: dict[str, Any]
    plan: Mapping[str, Any]
    meta: Mapping[str, Any]
    evaluate: bool = True


@dataclass(frozen=True)
class ValidateTask:
    """The final model theta_g^T, sent to every site taking part after the last round."""

    num_rounds: int
    targets: list[str]
    params: dict[str, Any]
    meta: Mapping[str, Any]


class Transport(ABC):
    """How :func:`run_rounds` reaches the sites, and what the owner of the run adds around a round.

    :meth:`site_names`, :meth:`train` and :meth:`validate` carry the tasks; the other methods are
    hooks that do nothing unless a transport overrides them.
    """

    @abstractmethod
    def site_names(self) -> list[str]:
        """The sites that take part now (the sampling draws from them; the final task goes to all)."""

    @abstractmethod
    def train(self, task: TrainTask) -> list[ClientResult]:
        """Send the training task to ``task.targets``; the results that came back, in any order."""

    @abstractmethod
    def validate(self, task: ValidateTask) -> list[Mapping[str, Any]]:
        """Send the final model to ``task.targets``; the metrics of every usable answer, in site order."""

    # -- hooks -------------------------------------------------------------------------------------
    def stop_before(self, round_index: int) -> bool:
        """True ends the run before round ``round_index``, without the final evaluation."""
        return False

    def aborted(self) -> bool:
        """True ends the rounds; the final evaluation still runs as configured."""
        return False

    def round_started(self, round_index: int, backend: AggregationBackend) -> None:
        """A round begins (before the sites are sampled)."""
        return None

    def before_aggregation(self, round_index: int) -> None:
        """The round's results are in; the round step runs next."""
        return None

    def after_aggregation(self, round_index: int, outcome: RoundOutcome) -> bool:
        """The round step ran (the transport may add sites it left out to ``outcome.excluded``);
        False ends the run without the final evaluation once the outcome is recorded."""
        return True

    def free_memory(self, round_index: int) -> None:
        """After a round that changed the global model, once the round's results are released."""
        return None

    def global_metrics(self, params: Params) -> dict[str, float]:
        """Metrics the server measures itself on the global model it sends (recorded on its row)."""
        return {}

    def round_values(self) -> dict[str, float]:
        """Values recorded on the row of a round that changed the global model."""
        return {}

    def round_saved(self, round_index: int, backend: AggregationBackend, rows: list[dict]) -> None:
        """A round that changed the global model is recorded (before its rows are written)."""
        return None


def run_rounds(
    step: RoundStep,
    transport: Transport,
    recorder: RoundRecorder,
    plan: Mapping[str, Any],
    settings: LoopSettings | None = None,
    log: Callable[[str], None] | None = None,
) -> bool:
    """Rounds ``settings.first_round`` .. T of a run, then the final evaluation (module docstring).

    ``plan``: what the sites receive with every training task (:meth:`RoundStep.plan`, plus what the
    transport adds). ``log``: where the progress goes (one line per round). Returns False when the
    transport ended the run early (no final evaluation), True otherwise.
    """
    settings = settings or LoopSettings()
    log = log or logger.info
    backend, num_rounds = step.backend, step.num_rounds
    stopped = False
    for t in range(settings.first_round, num_rounds + 1):
        if transport.stop_before(t):
            stopped = True
            break
        if transport.aborted():
            log("abort signal received; stopping")
            break
        t0 = time.perf_counter()
        transport.round_started(t, backend)
        targets = sample_sites(
            transport.site_names(), settings.sample_fraction, step.safeguards.min_clients, settings.seed, t
        )
        log(f"round {t}/{num_rounds}: sites {targets}")
        task = TrainTask(
            t, num_rounds, targets, backend.task_params(), plan, backend.task_meta(), settings.scored(t)
        )
        results = transport.train(task)
        transport.before_aggregation(t)
        outcome = step.run(t, results, targets)
        results = None  # this round's client models
        carry_on = transport.after_aggregation(t, outcome)
        measured = transport.global_metrics(task.params) if task.evaluate else {}
        task = None
        if carry_on and outcome.updated:
            transport.free_memory(t)
            recorder.add_outcome(outcome, round_seconds=time.perf_counter() - t0, **transport.round_values())
        else:
            recorder.add_outcome(outcome)
        if measured:
            recorder.set_metrics(t - 1, measured)
        if not carry_on:
            stopped = True
            recorder.flush()
            break
        if outcome.updated:
            log(f"round {t}: weights " + ", ".join(f"{k}={v:.3f}" for k, v in outcome.weights.items()))
            transport.round_saved(t, backend, recorder.rows)
        recorder.flush()
    if not stopped and (settings.evaluate_final or backend.encrypted):
        params = backend.task_params()
        answers = transport.validate(
            ValidateTask(num_rounds, sorted(transport.site_names()), params, backend.task_meta())
        )
        measured = transport.global_metrics(params)
        if answers:
            recorder.set_site_metrics(num_rounds, mean_metrics(answers))
        if measured:
            recorder.set_metrics(num_rounds, measured)
    recorder.flush()
    return not stopped
