"""The sites of one benchmark cell: trained in this process, or in parallel worker processes, and
the round loop's in-process transport that drives them.

:class:`LocalSites` holds one :class:`fedweigh.site.trainer.SiteTrainer` per site in this process;
:class:`SitePool` spreads the sites over ``workers`` persistent processes (spawned once per process
and reused by every cell that follows, one torch intra-op thread each; sites balanced by
training-set size), so a cell's sites train in parallel. Both keep every site's trainer (model,
optimizer state, DP account) for the whole cell and answer the same calls, so
:class:`InProcessSites`, the transport of :func:`fedweigh.server.loop.run_rounds` for the benchmark,
does not know which it drives. Results are the same either way: each site trains with its own
seeds, in its own process or not.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fedweigh.arrays import Params
from fedweigh.data.base import LabeledImages, SiteData
from fedweigh.histograms import GlobalStats
from fedweigh.protocol import META_NUM_SAMPLES, META_NUM_STEPS, META_SCALARS
from fedweigh.secure.stats_release import ReleasedHistogram
from fedweigh.server.loop import TrainTask, Transport, ValidateTask
from fedweigh.server.rounds import ClientResult
from fedweigh.site.args import ClientArgs
from fedweigh.site.policy import SitePolicy
from fedweigh.site.trainer import RoundOutput, SiteTrainer
from fedweigh.train import set_params

__all__ = ["InProcessSites", "LocalSites", "SitePool", "balance", "make_sites", "site_pool", "site_result"]


class LocalSites:
    """Every site's trainer in this process."""

    def __init__(
        self,
        sites: Sequence[SiteData],
        test: LabeledImages,
        args: ClientArgs,
        threads: int | None,
        policy: SitePolicy | None = None,
    ):
        # every site under ``policy`` (None: the simulation default, statistics noised with epsilon 1.0);
        # the statistics noise drawn from the cell's seed, so that a cell is the same in any process
        self.trainers = {
            s.name: SiteTrainer(s, test, args, threads=threads, policy=policy, release_seed=args.seed)
            for s in sites
        }

    @property
    def names(self) -> list[str]:
        return sorted(self.trainers)

    def released_statistics(self) -> dict[str, ReleasedHistogram]:
        return {name: t.released_statistics() for name, t in self.trainers.items()}

    def set_global_stats(self, stats: GlobalStats) -> None:
        for trainer in self.trainers.values():
            trainer.global_stats = stats

    def run_round(
        self, targets: Sequence[str], global_params: Params, t: int, plan: dict, rounds: int, evaluate: bool
    ) -> dict[str, RoundOutput]:
        """Round t at each target (NVFlare's current_round = t - 1 and total_rounds = T, as the
        controller sends them)."""
        return {
            site: self.trainers[site].run_round(
                global_params, t - 1, plan, total_rounds=rounds, evaluate_received=evaluate
            )
            for site in targets
        }

    def evaluate(self, params: Params) -> list[dict[str, float]]:
        """Every site's metrics of ``params`` (the controller's final ``validate`` task)."""
        out = []
        for trainer in self.trainers.values():
            set_params(trainer.model, params)
            out.append(trainer.evaluate())
        return out

    def close(self) -> None:
        self.trainers = {}


def _serve(conn: Any) -> None:
    """A worker process: the trainers of the sites it is given, answering the pool's calls."""
    torch.set_num_threads(1)
    local: LocalSites | None = None
    while True:
        call, payload = conn.recv()
        if call == "stop":
            break
        try:
            if call == "ping":
                value = None
            elif call == "load":
                sites, test, args, policy = payload
                local = LocalSites(sites, test, args, threads=1, policy=policy)
                value = None
            elif call == "unload":
                local, value = None, None
            else:
                assert local is not None, "no sites loaded"
                value = getattr(local, call)(*payload)
            conn.send(("ok", value))
        except Exception as e:  # the pool re-raises it in the parent
            conn.send(("error", f"{type(e).__name__}: {e}"))


def balance(sites: Sequence[SiteData], workers: int) -> list[list[SiteData]]:
    """Sites split into at most ``workers`` groups of about equal training work (largest first)."""
    groups: list[list[SiteData]] = [[] for _ in range(max(1, min(workers, len(sites))))]
    load = [0] * len(groups)
    for site in sorted(sites, key=lambda s: (-len(s.train), s.name)):
        i = load.index(min(load))
        groups[i].append(site)
        load[i] += len(site.train)
    return groups


class SitePool:
    """Worker processes that train a cell's sites in parallel (module docstring).

    :meth:`load` hands the processes a cell's sites (balanced by training-set size), :meth:`close`
    drops them again; the processes stay for the next cell until :meth:`shutdown`.
    """

    def __init__(self, workers: int):
        ctx = mp.get_context("spawn")
        self._workers = []
        for _ in range(workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child,), daemon=True)
            proc.start()
            child.close()
            self._workers.append((proc, parent))
        self._site_of: dict[str, Any] = {}
        self._call_all([conn for _, conn in self._workers], "ping")  # ready: imports done

    @property
    def size(self) -> int:
        return len(self._workers)

    def load(
        self,
        sites: Sequence[SiteData],
        test: LabeledImages,
        args: ClientArgs,
        policy: SitePolicy | None = None,
    ) -> SitePool:
        """Give the processes the sites of one cell (each builds their trainers, under ``policy``)."""
        self._site_of = {}
        conns = []
        for group, (_, conn) in zip(balance(sites, self.size), self._workers, strict=False):
            conn.send(("load", (group, test, args, policy)))
            conns.append(conn)
            for s in group:
                self._site_of[s.name] = conn
        for conn in conns:
            status, value = conn.recv()
            if status == "error":
                raise RuntimeError(f"site worker: {value}")
        return self

    @property
    def names(self) -> list[str]:
        return sorted(self._site_of)

    def _call_all(self, conns: Sequence[Any], call: str, *payload: Any) -> list[Any]:
        for conn in conns:
            conn.send((call, payload))
        answers = []
        for conn in conns:
            status, value = conn.recv()
            if status == "error":
                raise RuntimeError(f"site worker: {value}")
            answers.append(value)
        return answers

    def _all(self) -> list[Any]:
        return list({id(c): c for c in self._site_of.values()}.values())

    def released_statistics(self) -> dict[str, ReleasedHistogram]:
        return {k: v for part in self._call_all(self._all(), "released_statistics") for k, v in part.items()}

    def set_global_stats(self, stats: GlobalStats) -> None:
        self._call_all(self._all(), "set_global_stats", stats)

    def run_round(
        self, targets: Sequence[str], global_params: Params, t: int, plan: dict, rounds: int, evaluate: bool
    ) -> dict[str, RoundOutput]:
        by_conn: dict[int, tuple[Any, list[str]]] = {}
        for site in targets:
            conn = self._site_of[site]
            by_conn.setdefault(id(conn), (conn, []))[1].append(site)
        conns = [c for c, _ in by_conn.values()]
        for conn, names in by_conn.values():
            conn.send(("run_round", (names, global_params, t, plan, rounds, evaluate)))
        merged: dict[str, RoundOutput] = {}
        for conn in conns:
            status, value = conn.recv()
            if status == "error":
                raise RuntimeError(f"site worker: {value}")
            merged.update(value)
        return {site: merged[site] for site in targets}

    def evaluate(self, params: Params) -> list[dict[str, float]]:
        return [m for part in self._call_all(self._all(), "evaluate", params) for m in part]

    def close(self) -> None:
        """Drop the cell's sites; the processes stay for the next cell."""
        conns = self._all()
        self._site_of = {}
        self._call_all(conns, "unload")

    def shutdown(self) -> None:
        """Stop the processes."""
        for proc, conn in self._workers:
            try:
                conn.send(("stop", ()))
            except (BrokenPipeError, OSError):
                pass
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self._workers = []


_POOLS: dict[int, SitePool] = {}


def site_pool(workers: int) -> SitePool:
    """This process's pool of ``workers`` site processes, started on first use and kept until exit."""
    pool = _POOLS.get(workers)
    if pool is None or not all(proc.is_alive() for proc, _ in pool._workers):
        pool = _POOLS[workers] = SitePool(workers)
    return pool


@atexit.register
def _shutdown_pools() -> None:
    for pool in _POOLS.values():
        pool.shutdown()
    _POOLS.clear()


def make_sites(
    sites: Sequence[SiteData],
    test: LabeledImages,
    args: ClientArgs,
    workers: int,
    policy: SitePolicy | None = None,
) -> LocalSites | SitePool:
    """The cell's sites in this process (``workers`` <= 1) or spread over ``workers`` processes, every
    site under ``policy`` (None: the simulation default, :data:`fedweigh.site.policy.PERMISSIVE_DEFAULT`)."""
    if workers <= 1 or len(sites) <= 1:
        return LocalSites(sites, test, args, threads=args.threads or None, policy=policy)
    return site_pool(min(workers, len(sites))).load(sites, test, args, policy)


def site_result(site: str, out: RoundOutput) -> ClientResult:
    """A site's round as the NVFlare client script sends it (same meta keys)."""
    meta = {META_NUM_SAMPLES: out.num_samples, META_NUM_STEPS: out.num_steps, META_SCALARS: out.scalars}
    return ClientResult(site=site, params=out.params, meta=meta, metrics=out.metrics)


class InProcessSites(Transport):
    """The round loop's transport for the benchmark (:class:`fedweigh.server.loop.Transport`).

    The cell's sites (:class:`LocalSites` or :class:`SitePool`) answer the loop's tasks as the NVFlare
    client script does: a training task is each target's :meth:`SiteTrainer.run_round
    <fedweigh.site.trainer.SiteTrainer.run_round>` (evaluating the received model only in the rounds
    the loop scores), the final task every site's evaluation. ``score`` gives the server's own
    metrics of a global model (the benchmark's global test set): one scoring instead of one by every
    sampled site, which would score the same model on the same images.
    """

    def __init__(self, sites: LocalSites | SitePool, score: Callable[[Params], dict[str, float]]):
        self.sites = sites
        self.score = score

    def site_names(self) -> list[str]:
        return self.sites.names

    def train(self, task: TrainTask) -> list[ClientResult]:
        outs = self.sites.run_round(
            task.targets, task.params, task.round_index, dict(task.plan), task.num_rounds, task.evaluate
        )
        return [site_result(site, out) for site, out in outs.items()]

    def validate(self, task: ValidateTask) -> list[dict[str, float]]:
        """Every site's metrics of the final model (in-process sites never refuse or fail to answer)."""
        return self.sites.evaluate(task.params)

    def global_metrics(self, params: Params) -> dict[str, float]:
        return self.score(params)
