"""FedweighController: NVFlare ``ModelController`` that weights clients with a fedweigh scheme.

Per round t = 1..T: sample sites, send the global model theta_g^{t-1} with the scheme's plan,
validate every result (an invalid one is skipped with a logged reason naming the site), reduce
results to :class:`~fedweigh.weighting.base.ClientReport`, ask the scheme for weights, and set
theta_g^t = scheme.aggregate(theta_g^{t-1}, reports, weights). The scheme's math lives in
:mod:`fedweigh.weighting`; this module only wires it into NVFlare.

After each round the global model is persisted through the job's persistor and the run state
(round, scheme state, metric rows) to ``fedweigh_state.json`` + ``fedweigh_global.npz``, so a run
started with ``resume_from`` pointing at that folder continues at round t+1 with the same state.

With ``he=True`` (homomorphically encrypted updates, :mod:`fedweigh.secure_updates`) sites send
Enc(theta_k - theta_g); the server weights from scalars only, keeps Enc(theta_g^t) =
Enc(theta_g^{t-1}) + sum_k w_k Enc(Delta_k) without any secret key and sends it with the next task.
It then never holds a plaintext model after round 1: nothing goes to the persistor, and the run
state keeps the ciphertext in ``fedweigh_he_global.npz`` instead of ``fedweigh_global.npz``. The
sites keep the decrypted global model; the final ``validate`` task, always sent under HE, gives
them theta_g^T.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.workflows.model_controller import ModelController

from fedweigh.flare.constants import (
    META_NUM_SAMPLES,
    META_PLAN,
    META_SCALARS,
    STATE_JSON,
    TASK_TRAIN,
    TASK_VALIDATE,
)
from fedweigh.flare.recorder import RoundRecorder
from fedweigh.flare.validation import InvalidClientResult, ResultLimits, check_train_result
from fedweigh.rounds import client_plan, mean_metrics, sample_sites, weigh_and_aggregate

GLOBAL_NPZ = "fedweigh_global.npz"
HE_GLOBAL_NPZ = "fedweigh_he_global.npz"


def _server_memory_mb() -> dict[str, float]:
    """The server process's current and peak resident memory (Linux /proc; empty elsewhere)."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    out["server_rss_mb"] = int(line.split()[1]) / 1024
                elif line.startswith("VmHWM:"):
                    out["server_peak_rss_mb"] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def _to_numpy(params: dict) -> dict[str, np.ndarray]:
    out = {}
    for k, v in params.items():
        if hasattr(v, "detach"):
            v = v.detach().cpu().numpy()
        out[k] = np.asarray(v)
    return out


class FedweighController(ModelController):
    """Runs a fedweigh weighting scheme inside NVFlare.

    Args:
        num_rounds: number of training rounds T.
        min_clients: minimum number of valid results for a round to update the global model.
        scheme: registry name of the weighting scheme (``fedavg``, ``feddraw``, ``cbr``, ...).
        scheme_args: keyword arguments of the scheme (its dataclass fields).
        sample_fraction: fraction of sites sampled per round (partial participation).
        statistics: label-statistics exchange before training: ``"none"``, ``"plain"`` or ``"secure"``.
        loss_needs_global_stats: run the statistics phase even if the scheme does not need it
            (losses such as PNB or DAFL use the global histogram).
        train_timeout: seconds to wait for a task's results (training, statistics, final
            validation); a site that has not answered by then is left out of that task. 0: wait for
            every site.
        evaluate_final: send a ``validate`` task with the final global model.
        seed: seed of the site sampling.
        resume_from: folder holding ``fedweigh_state.json`` of an earlier run to continue.
        max_num_samples: plausibility bound on a site's reported sample count.
        persistor_id: component id of the model persistor.
        he: homomorphically encrypted model updates (CKKS); refused for schemes that need plaintext
            client models (IDA, FedAWA, FedAdp, FedDRAW with similarity="delta").
        he_layers: with ``he``, encrypt only the floating-point arrays matching these glob patterns
            or selectors (``first:N``, ``last:N``, ``largest:N``); the others travel in clear.
            None: encrypt every floating-point array.
        max_share: cap on any one site's share of a round's total weight (water-filling,
            :func:`fedweigh.rounds.cap_weights`); bounds a site that inflates its sample count or
            statistics. None: no cap.
        stop_after: end this run after that round (its state is saved; continue it with
            ``resume_from``).
        memory_gc_rounds: every that many rounds, free the round's client results and return the
            memory to the system (NVFlare's ``cleanup_memory``: gc.collect + malloc_trim), so the
            server's resident memory stays flat over long runs; 0 = never.
    """

    def __init__(
        self,
        num_rounds: int = 5,
        min_clients: int = 1,
        scheme: str = "fedavg",
        scheme_args: dict | None = None,
        sample_fraction: float = 1.0,
        statistics: str = "none",
        loss_needs_global_stats: bool = False,
        train_timeout: int = 0,
        evaluate_final: bool = True,
        seed: int = 0,
        resume_from: str | None = None,
        max_num_samples: int = 10_000_000,
        persistor_id: str = "persistor",
        he: bool = False,
        he_layers: list[str] | None = None,
        max_share: float | None = None,
        stop_after: int | None = None,
        memory_gc_rounds: int = 1,
    ):
        # resilient mode: a failed site's error result is logged and left out, never a panic; the
        # round then stands or falls on min_clients (see run())
        super().__init__(persistor_id=persistor_id, ignore_result_error=True)
        from fedweigh.weighting import get_scheme

        if num_rounds < 1:
            raise ValueError(f"num_rounds must be >= 1, got {num_rounds}")
        if not 0.0 < sample_fraction <= 1.0:
            raise ValueError(f"sample_fraction must be in (0, 1], got {sample_fraction}")
        if statistics not in ("none", "plain", "secure"):
            raise ValueError(f"statistics must be 'none', 'plain' or 'secure', got {statistics!r}")
        self.num_rounds = num_rounds
        self.min_clients = min_clients
        self.scheme = scheme
        self.scheme_args = dict(scheme_args or {})
        self.sample_fraction = sample_fraction
        self.statistics = statistics
        self.loss_needs_global_stats = loss_needs_global_stats
        self.train_timeout = train_timeout
        self.evaluate_final = evaluate_final
        self.seed = seed
        self.resume_from = resume_from
        self.max_num_samples = max_num_samples
        if max_share is not None and not 0.0 < max_share <= 1.0:
            raise ValueError(f"max_share must be in (0, 1], got {max_share}")
        self.max_share = max_share
        if stop_after is not None and not 1 <= stop_after <= num_rounds:
            raise ValueError(f"stop_after must be in 1..num_rounds={num_rounds}, got {stop_after}")
        self.stop_after = stop_after
        if (
            isinstance(memory_gc_rounds, bool)
            or not isinstance(memory_gc_rounds, int)
            or memory_gc_rounds < 0
        ):
            raise ValueError(f"memory_gc_rounds must be an integer >= 0, got {memory_gc_rounds!r}")
        self.memory_gc_rounds = memory_gc_rounds
        self._scheme = get_scheme(scheme, **self.scheme_args)  # fails at job creation on a bad name/option
        if self._scheme.needs_global_histogram and statistics == "none":
            raise ValueError(
                f"scheme {scheme!r} needs the global label histogram: set statistics='secure' (or 'plain')"
            )
        self.he = bool(he)
        self.he_layers = he_layers
        if he_layers is not None and (
            isinstance(he_layers, str) or not all(isinstance(p, str) and p for p in he_layers)
        ):
            raise ValueError(f"he_layers must be a list of non-empty patterns, got {he_layers!r}")
        if he_layers and not self.he:
            raise ValueError("he_layers selects the layers to encrypt: it needs he=True")
        if self.he:
            from fedweigh.secure_updates import check_he_scheme

            check_he_scheme(self._scheme)  # fails at job creation, naming the scheme and the reason

    # -- helpers -------------------------------------------------------------------------------
    def ask_sites(
        self, task_name: str, data: FLModel, targets: list[str], min_responses: int
    ) -> list[FLModel]:
        """Send a task and wait for the results: for every target, or, with ``train_timeout``, for
        every target up to that many seconds (then go on with what came; a site that failed or did
        not answer is missing from the list)."""
        return self.broadcast_model(
            task_name=task_name,
            data=data,
            targets=targets,
            min_responses=min_responses if self.train_timeout else None,
            timeout=self.train_timeout,
            wait_time_after_min_received=self.train_timeout,
        )

    def _out_dir(self) -> Path:
        return Path(self.get_app_dir())

    def _save_state(
        self,
        out_dir: Path,
        round_index: int,
        params: dict[str, np.ndarray] | None,
        rows: list[dict],
        he_model=None,
    ):
        state = {
            "round": round_index,
            "num_rounds": self.num_rounds,
            "scheme": self.scheme,
            "scheme_args": self.scheme_args,
            "scheme_state": self._scheme.state_dict(),
            "rows": rows,
        }
        tmp = out_dir / (STATE_JSON + ".tmp")
        tmp.write_text(json.dumps(state))
        if he_model is not None:  # ciphertext and clear arrays only
            he_model.save(out_dir / HE_GLOBAL_NPZ)
        else:
            np.savez(out_dir / ("tmp_" + GLOBAL_NPZ), **params)
            os.replace(out_dir / ("tmp_" + GLOBAL_NPZ), out_dir / GLOBAL_NPZ)
        os.replace(tmp, out_dir / STATE_JSON)

    def _load_state(self, folder: str) -> tuple[int, dict[str, np.ndarray], list[dict]]:
        path = Path(folder) / STATE_JSON
        if not path.is_file():
            raise FileNotFoundError(f"resume_from={folder}: no {STATE_JSON} there")
        state = json.loads(path.read_text())
        if state.get("scheme") != self.scheme:
            raise ValueError(
                f"resume_from={folder}: state is for scheme {state.get('scheme')!r}, not {self.scheme!r}"
            )
        if self.he:  # the encrypted global model is restored in run()
            if not (Path(folder) / HE_GLOBAL_NPZ).is_file():
                raise FileNotFoundError(f"resume_from={folder}: he=True but there is no {HE_GLOBAL_NPZ}")
            params = {}
        else:
            with np.load(Path(folder) / GLOBAL_NPZ) as npz:
                params = {k: npz[k] for k in npz.files}
        self._scheme.load_state_dict(state.get("scheme_state") or {})
        return int(state["round"]), params, list(state.get("rows", []))

    # -- HE helpers ----------------------------------------------------------------------------
    def _start_he(self, initial: dict[str, np.ndarray]):
        """The server's encrypted global model, from the initial model or the state to resume."""
        from fedweigh.flare.secure_statistics import load_role_context
        from fedweigh.secure_updates import EncryptedGlobalModel

        ctx, location = load_role_context("server")
        he_model = EncryptedGlobalModel(ctx, initial, self.he_layers)
        if self.resume_from:
            he_model.load(Path(self.resume_from) / HE_GLOBAL_NPZ)
        layout = he_model.layout
        self.info(
            f"HE model updates: {len(layout.keys)} of {len(initial)} arrays encrypted ({layout.num_values} "
            f"values, {layout.num_chunks} ciphertexts per update), {len(he_model.clear)} in clear; "
            f"server context from {location.path} ({location.source})"
        )
        return he_model

    def _check_he_result(self, he_model, result: FLModel, limits: ResultLimits):
        """(ClientReport without parameters, EncryptedContribution) of one HE training result."""
        from fedweigh.flare.validation import check_count, check_scalars
        from fedweigh.secure_updates import he_required_scalars
        from fedweigh.weighting.base import ClientReport

        meta = result.meta or {}
        site = meta.get("client_name", "?")
        if META_NUM_SAMPLES not in meta:
            raise InvalidClientResult(f"{site}: meta lacks {META_NUM_SAMPLES!r}")
        n = check_count(site, META_NUM_SAMPLES, meta[META_NUM_SAMPLES], limits.max_num_samples)
        steps = check_count(
            site, "NUM_STEPS_CURRENT_ROUND", meta.get("NUM_STEPS_CURRENT_ROUND", 1), limits.max_num_steps
        )
        scalars = check_scalars(site, meta.get(META_SCALARS), he_required_scalars(self._scheme), limits)
        try:
            contribution = he_model.check_result(site, result.params)
        except ValueError as e:
            raise InvalidClientResult(str(e)) from None
        return ClientReport(name=site, num_samples=n, num_steps=steps, scalars=scalars), contribution

    # -- the workflow --------------------------------------------------------------------------
    def run(self) -> None:
        from fedweigh.weighting.base import ClientReport

        out_dir = self._out_dir()
        start_round, rows = 1, []
        if self.resume_from:
            last, params, rows = self._load_state(self.resume_from)
            model = FLModel(params_type=ParamsType.FULL, params=params)
            start_round = last + 1
            self.info(f"resuming from {self.resume_from} after round {last}")
        else:
            model = self.load_model()
        if self.he and self.resume_from:
            model = self.load_model()  # names, shapes and dtypes; the values come from the HE state
        global_params = _to_numpy(model.params)
        he_model = self._start_he(global_params) if self.he else None
        recorder = RoundRecorder(out_dir, self.scheme, rows)
        limits = ResultLimits(max_num_samples=self.max_num_samples)
        all_sites = [c.name for c in self.engine.get_clients()]

        if self.statistics != "none" and (
            self._scheme.needs_global_histogram or self.loss_needs_global_stats
        ):
            from fedweigh.flare.statistics import run_statistics_phase

            run_statistics_phase(self, sorted(all_sites), self.statistics)

        stopped = False
        for t in range(start_round, self.num_rounds + 1):
            if self.stop_after is not None and t > self.stop_after:
                self.info(
                    f"stopping after round {self.stop_after} as configured; continue this run with "
                    f"resume_from={str(out_dir)!r}"
                )
                stopped = True
                break
            if self.abort_signal and self.abort_signal.triggered:
                self.info("abort signal received; stopping")
                break
            t0 = time.perf_counter()
            targets = sample_sites(all_sites, self.sample_fraction, self.min_clients, self.seed, t)
            self.info(f"round {t}/{self.num_rounds}: sites {targets}")
            plan = client_plan(self.scheme, self.scheme_args, self._scheme)
            task_params, task_meta = global_params, {META_PLAN: plan}
            if he_model is not None:
                from fedweigh.secure_updates import META_HE, he_required_scalars

                plan["scalars"] = list(he_required_scalars(self._scheme))
                task_params, task_meta = he_model.task_params(), {META_PLAN: plan, META_HE: he_model.meta()}
            task_model = FLModel(
                params_type=ParamsType.FULL,
                params=task_params,
                current_round=t - 1,  # NVFlare counts rounds from 0
                total_rounds=self.num_rounds,
                meta=task_meta,
            )
            results = self.ask_sites(TASK_TRAIN, task_model, targets, self.min_clients)
            reports, valid_results, contributions = [], [], []
            excluded: dict[str, str] = {}
            for r in results:
                site = (r.meta or {}).get("client_name", "?")
                if he_model is not None:
                    try:
                        report, contribution = self._check_he_result(he_model, r, limits)
                    except InvalidClientResult as e:
                        self.warning(f"round {t}: skipping result: {e}")
                        excluded[site] = str(e)
                        continue
                    reports.append(report)
                    contributions.append(contribution)
                    valid_results.append(r)
                    continue
                try:
                    params, n, steps, scalars = check_train_result(
                        site, r.params, r.meta, global_params, self._scheme.required_scalars, limits
                    )
                except InvalidClientResult as e:
                    self.warning(f"round {t}: skipping result: {e}")
                    excluded[site] = str(e)
                    continue
                reports.append(
                    ClientReport(
                        name=site,
                        num_samples=n,
                        num_steps=steps,
                        scalars=scalars,
                        params=params,
                    )
                )
                valid_results.append(r)
            answered = {(r.meta or {}).get("client_name") for r in results}
            for site in targets:
                if site not in answered:
                    excluded[site] = "no result (failed, or no answer within train_timeout)"
                    self.warning(f"round {t}: {site} sent no valid result in time; left out of this round")
            if valid_results:
                recorder.set_metrics(t - 1, mean_metrics([r.metrics or {} for r in valid_results]))
            if len(reports) < self.min_clients:
                self.warning(
                    f"round {t}: {len(reports)} valid result(s), fewer than min_clients={self.min_clients}; "
                    "the global model is left unchanged"
                )
                recorder.set_excluded(t, excluded, updated=False)
                recorder.flush()
                continue
            try:
                if he_model is not None:
                    update = he_model.aggregate(
                        self._scheme, reports, contributions, t, self.num_rounds, self.max_share
                    )
                else:
                    update = weigh_and_aggregate(
                        self._scheme, global_params, reports, t, self.num_rounds, self.max_share
                    )
            except ValueError as e:
                self.warning(
                    f"round {t}: the scheme could not weight this round ({e}); global model unchanged"
                )
                recorder.set_excluded(t, excluded, updated=False)
                recorder.flush()
                continue
            global_params, wmap, values = update.params, update.weights, update.values
            recorder.set_excluded(t, excluded, updated=True)
            results = reports = valid_results = contributions = update = None  # this round's client models
            if self.memory_gc_rounds and t % self.memory_gc_rounds == 0:
                from nvflare.fuel.utils.memory_utils import cleanup_memory

                cleanup_memory()
            values["round_seconds"] = time.perf_counter() - t0
            values.update(_server_memory_mb())
            recorder.set_round(t, wmap, values)
            self.info(f"round {t}: weights " + ", ".join(f"{k}={v:.3f}" for k, v in wmap.items()))

            if he_model is not None:  # no plaintext model to persist: the state keeps the ciphertext
                self._save_state(out_dir, t, None, recorder.rows, he_model=he_model)
                recorder.flush()
                continue
            model = FLModel(
                params_type=ParamsType.FULL,
                params=global_params,
                current_round=t - 1,
                total_rounds=self.num_rounds,
            )
            self.save_model(model)
            self._save_state(out_dir, t, global_params, recorder.rows)
            recorder.flush()

        if not stopped and (self.evaluate_final or he_model is not None):
            # under HE this task delivers theta_g^T to the sites
            final = FLModel(params_type=ParamsType.FULL, params=global_params, current_round=self.num_rounds)
            if he_model is not None:
                from fedweigh.secure_updates import META_HE

                final = FLModel(
                    params_type=ParamsType.FULL,
                    params=he_model.task_params(),
                    current_round=self.num_rounds,
                    meta={META_HE: he_model.meta()},
                )
            results = self.ask_sites(TASK_VALIDATE, final, sorted(all_sites), 1)
            ok = [r for r in results if r.metrics and (r.meta or {}).get(META_NUM_SAMPLES) is not None]
            if ok:
                recorder.set_metrics(self.num_rounds, mean_metrics([r.metrics or {} for r in ok]))
        recorder.flush()
        for path in recorder.plot():
            self.info(f"wrote {path}")
        recorder.close()
        self.info(f"metrics: {out_dir}")
