"""FedweighController: NVFlare ``ModelController`` that weights clients with a fedweigh scheme.

The rounds are :func:`fedweigh.server.loop.run_rounds` (sample sites, send the global model
theta_g^{t-1} with the scheme's plan, hand the results to :class:`fedweigh.server.rounds.RoundStep`,
record), the loop the benchmark runs too; this module is its NVFlare transport,
:class:`NVFlareTasks`: the tasks go out through ``broadcast_model``, and each round fires NVFlare's
round events (``ROUND_STARTED``, ``BEFORE_AGGREGATION``, ``AFTER_AGGREGATION``), as its own ``FedAvg``
does, so that model selection and the other event-driven widgets work. The scheme's math lives in
:mod:`fedweigh.weighting`, the round in :mod:`fedweigh.server`; this module only wires them into
NVFlare.

Every number the controller records of a round (:class:`~fedweigh.server.records.RoundRecorder`: the
sites' mean metrics of the global model, each site's weight, the scheme's values) is also fired as
NVFlare's analytics event (:class:`~fedweigh.flare.tracking.ServerAnalytics`), so the receivers of
``add_experiment_tracking`` record it; step = fedweigh's round.

After each round the global model is persisted through the job's persistor and the run state
(round, scheme state, metric rows) to ``fedweigh_state.json`` + ``fedweigh_global.npz``, so a run
started with ``resume_from`` pointing at that folder continues at round t+1 with the same state.

With ``he=True`` (homomorphically encrypted updates, :mod:`fedweigh.secure.updates`) sites send
Enc(theta_k - theta_g); the server weights from scalars only, keeps Enc(theta_g^t) =
Enc(theta_g^{t-1}) + sum_k w_k Enc(Delta_k) without any secret key and sends it with the next task.
It then never holds a plaintext model after round 1: nothing goes to the persistor, and the run
state keeps the ciphertext in ``fedweigh_he_global.npz`` instead of ``fedweigh_global.npz``. The
sites keep the decrypted global model; the final ``validate`` task, always sent under HE, gives
them theta_g^T.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np
from nvflare.apis.fl_constant import ReturnCode
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.app_common.utils.fl_model_utils import FLModelUtils
from nvflare.app_common.workflows.model_controller import ModelController
from nvflare.fuel.utils.memory_utils import cleanup_memory

from fedweigh.arrays import Params, to_numpy_dict
from fedweigh.checks import check_server_values
from fedweigh.errors import ConfigError
from fedweigh.flare.keys import load_role_context
from fedweigh.flare.persistor import check_server_path
from fedweigh.flare.statistics import run_statistics_phase
from fedweigh.flare.tracking import ServerAnalytics
from fedweigh.io import atomic_write_npz, atomic_write_text
from fedweigh.protocol import (
    META_HE_REFUSED,
    META_NUM_SAMPLES,
    META_PLAN,
    META_REFUSED,
    META_REFUSED_JOB,
    META_SITE_ERROR,
    STATE_JSON,
    TASK_TRAIN,
    TASK_VALIDATE,
)
from fedweigh.server.declared import combine_declarations, load_declared_sizes, server_declaration
from fedweigh.server.loop import LoopSettings, TrainTask, Transport, ValidateTask, run_rounds
from fedweigh.server.model_check import ModelProbe
from fedweigh.server.quorum import server_floor
from fedweigh.server.records import RoundRecorder
from fedweigh.server.rounds import AggregationBackend, ClientResult, PlaintextBackend, RoundOutcome, RoundStep
from fedweigh.server.safeguards import (
    DEFAULT_MIN_UPDATE_COSINE,
    DEFAULT_UPDATE_NORM_BOUND,
    ROBUST_OPTIONS,
    AnnouncedCounts,
    Safeguards,
)
from fedweigh.server.validation import ResultLimits
from fedweigh.weighting import get_scheme
from fedweigh.weighting.base import WeightingScheme
from fedweigh.weighting.geometry import use_model_buffers

__all__ = [
    "DEFAULT_MIN_SECURE_SUM",
    "DEFAULT_TRAIN_TIMEOUT",
    "FedweighController",
    "NVFlareTasks",
    "client_result",
]

#: Default ``train_timeout`` (seconds): a site silent for longer is left out of that task, so no
#: single site can stall the job. Set it above the slowest round, site start-up included.
DEFAULT_TRAIN_TIMEOUT = 3600
#: Default ``min_secure_sum``: the fewest contributions to any secure sum (label statistics, HE updates).
DEFAULT_MIN_SECURE_SUM = 3

GLOBAL_NPZ = "fedweigh_global.npz"
#: How the controller's option errors name their source.
_SOURCE = "FedweighController"
#: The controller's options checked by fedweigh.checks.check_server_values besides the safeguards.
_RUN_OPTIONS = (
    "num_rounds",
    "sample_fraction",
    "statistics",
    "train_timeout",
    "stop_after",
    "memory_gc_rounds",
    "he_layers",
)
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


def client_result(model: FLModel) -> ClientResult:
    """An NVFlare result as the round step's plain :class:`~fedweigh.server.rounds.ClientResult`."""
    meta = model.meta if isinstance(model.meta, dict) else {}
    return ClientResult(
        site=str(meta.get("client_name", "?")), params=model.params, meta=meta, metrics=model.metrics
    )


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
            validation); a site that has not answered by then is left out of that task (default
            :data:`DEFAULT_TRAIN_TIMEOUT`). 0: wait for every site, however long (one silent site then
            stalls the job).
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
            :func:`fedweigh.server.safeguards.cap_weights`); bounds a site that inflates its sample count or
            forges its statistics. ``"auto"`` (default): half the weight once three or more sites
            count. None: no cap.
        update_norm_bound: scale every array of an update down to this many times the reference norm
            of the same array in the other sites' updates of the round (their (f + 1)-th largest,
            ``norm_colluders``; plaintext updates; default 1: no longer than an honest site's); None: off.
        min_update_cosine: leave out an update whose cosine with more than half of the other sites'
            updates is below this while those agree with each other (plaintext updates, three or more
            sites; default 0: an update opposing a consensus of the others,
            :func:`fedweigh.server.safeguards.direction_outliers`); None: off.
        min_secure_sum: the fewest contributions to any secure sum (the label statistics, an
            encrypted model aggregate) before anything is decrypted; at most the number of sites,
            never below 2; each site's policy may ask for more (default 3).
        aggregator: ``"mean"`` (default: the scheme's weighted mean), ``"median"`` (weighted
            coordinate-wise median) or ``"trimmed_mean"`` (weighted trimmed mean), with the scheme's
            weights (plaintext updates; :mod:`fedweigh.server.robust`, docs/security.md).
        trim: the weight mass the trimmed mean cuts from each tail, in [0, 0.5) (default 0.25).
        krum_f: multi-Krum: keep the K - f updates closest to their neighbours (None: off).
        array_cosine: the direction check per array, so that an update flipping a few arrays (the
            classifier) is caught: those arrays are left out of it (None: off).
        clip_norm: clip every update to this absolute L2 norm, as Flower's fixed clipping (None: off).
        nnm_f: nearest-neighbour mixing before the aggregation: each update replaced by the mean of its
            K - f nearest (None: off).
        norm_colluders: how many sites acting with the judged one the norm bound withstands: its
            reference is the (f + 1)-th largest of the other sites' norms (``"auto"``: floor((K - 1) / 4));
            ``"median"``: their median.
        declared_sizes: the consortium's declaration of each site's training-set size (a mapping
            site -> N_k, or the path of a JSON file holding one, read at the server): a reported N_k
            above it is clipped to it (:mod:`fedweigh.server.declared`). The server's operator may
            place one in the file ``FEDWEIGH_DECLARED_SIZES`` names; with both, the smaller counts.
            None: sizes as reported, clipped to ``max_count_ratio`` x the other sites' median.
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
        train_timeout: int = DEFAULT_TRAIN_TIMEOUT,
        evaluate_final: bool = True,
        seed: int = 0,
        resume_from: str | None = None,
        max_num_samples: int = 10_000_000,
        persistor_id: str = "persistor",
        he: bool = False,
        he_layers: list[str] | None = None,
        max_share: float | str | None = "auto",
        stop_after: int | None = None,
        memory_gc_rounds: int = 1,
        update_norm_bound: float | None = DEFAULT_UPDATE_NORM_BOUND,
        min_secure_sum: int = DEFAULT_MIN_SECURE_SUM,
        min_update_cosine: float | None = DEFAULT_MIN_UPDATE_COSINE,
        aggregator: str = "mean",
        trim: float = 0.25,
        krum_f: int | None = None,
        array_cosine: float | None = None,
        clip_norm: float | None = None,
        nnm_f: int | None = None,
        declared_sizes: dict[str, int] | str | None = None,
        norm_colluders: int | str = "auto",
    ):
        # resilient mode: a failed site's error result is logged and left out, never a panic; the
        # round then stands or falls on min_clients (the round step)
        super().__init__(persistor_id=persistor_id, ignore_result_error=True)
        # NVFlare exports a component from the constructor arguments it keeps as self.<argument>
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
        if resume_from is not None:  # only a folder the server's operator lets jobs read
            check_server_path(resume_from, "resume_from")
        self.resume_from = resume_from
        self.max_num_samples = max_num_samples
        self.he = bool(he)
        self.he_layers = he_layers
        self.stop_after = stop_after
        self.memory_gc_rounds = memory_gc_rounds
        self.min_secure_sum = min_secure_sum
        # every option is checked once, by its rule in fedweigh.checks (ConfigError naming it)
        check_server_values({name: getattr(self, name) for name in _RUN_OPTIONS}, _SOURCE)
        self._safeguards = Safeguards(
            min_clients,
            max_share,
            update_norm_bound,
            min_update_cosine,
            min_secure_sum,
            ResultLimits(max_num_samples=max_num_samples),
            aggregator=aggregator,
            trim=trim,
            krum_f=krum_f,
            array_cosine=array_cosine,
            clip_norm=clip_norm,
            nnm_f=nnm_f,
            declared_sizes=declared_sizes if isinstance(declared_sizes, Mapping) else None,
            norm_colluders=norm_colluders,
            source=_SOURCE,
        )
        if declared_sizes is not None and not isinstance(declared_sizes, (Mapping, str)):
            raise ConfigError(
                _SOURCE,
                "declared_sizes",
                declared_sizes,
                "a mapping of site name -> count, or the path of a JSON file holding one",
            )
        #: the job's declaration as given (a path is read when the run starts, at the server)
        self.declared_sizes = declared_sizes
        for name in ROBUST_OPTIONS:
            setattr(self, name, getattr(self._safeguards, name))
        if self.he and self._safeguards.robust:
            raise ValueError(
                f"{_SOURCE}: aggregator, krum_f, array_cosine, clip_norm and nnm_f need plaintext updates: "
                "turn them off with he=True"
            )
        self.max_share = self._safeguards.max_share  # numbers as floats
        self.update_norm_bound = self._safeguards.update_norm_bound
        self.norm_colluders = self._safeguards.norm_colluders
        self.min_update_cosine = self._safeguards.min_update_cosine
        self._scheme = self._job_scheme()
        #: sites whose answer to the task under way was an error (their error, or NVFlare's return code)
        self._task_failures: dict[str, str] = {}
        #: why the job failed (None while it has not)
        self.failure: str | None = None

    def _job_declaration(self) -> dict[str, int] | None:
        """The job's ``declared_sizes``: the mapping, or the file it names (a folder the server lets
        jobs read, :func:`~fedweigh.flare.persistor.check_server_path`)."""
        value = self.declared_sizes
        if isinstance(value, str):
            value = check_server_path(value, "declared_sizes")
        return load_declared_sizes(value, _SOURCE)

    def _job_scheme(self) -> WeightingScheme:
        """The job's weighting scheme; ValueError at job creation on a bad name or option, a scheme
        that needs the global label histogram without a statistics phase, or one that cannot run
        under HE (naming the scheme and the reason)."""
        if self.he_layers and not self.he:
            raise ValueError(f"{_SOURCE}: he_layers selects the layers to encrypt: it needs he=True")
        scheme = get_scheme(self.scheme, **self.scheme_args)
        if scheme.needs_global_histogram and self.statistics == "none":
            raise ValueError(
                f"scheme {self.scheme!r} needs the global label histogram: set statistics='secure' (or 'plain')"
            )
        if self.he:
            scheme.check_he()
        return scheme

    # -- helpers -------------------------------------------------------------------------------
    def ask_sites(
        self, task_name: str, data: FLModel, targets: list[str], min_responses: int
    ) -> list[FLModel]:
        """Send a task and wait for the results: for every target, or, with ``train_timeout``, for
        every target up to that many seconds (then go on with what came; a site that failed or did
        not answer is missing from the list; :meth:`site_errors` says why the failed ones did)."""
        self._task_failures = {}
        return self.broadcast_model(
            task_name=task_name,
            data=data,
            targets=targets,
            min_responses=min_responses if self.train_timeout else None,
            timeout=self.train_timeout,
            wait_time_after_min_received=self.train_timeout,
        )

    def _accept_train_result(self, client_name, result, fl_ctx, is_unknown_task: bool = False) -> bool:
        """NVFlare's check of a result's return code; an error is also kept for :meth:`site_errors`."""
        rc = result.get_return_code()
        if rc and rc != ReturnCode.OK and not is_unknown_task:
            self._task_failures.setdefault(
                client_name, f"its task ended with NVFlare return code {rc} (the site's log says why)"
            )
        return super()._accept_train_result(client_name, result, fl_ctx, is_unknown_task)

    def site_errors(self, results: list[FLModel]) -> dict[str, str]:
        """Why sites failed the last task: the error a site's script sent (``META_SITE_ERROR``), or the
        return code of a task that ended in error; by site, in the order they came."""
        errors: dict[str, str] = {}
        for r in results:
            meta = r.meta if isinstance(r.meta, dict) else {}
            if meta.get(META_SITE_ERROR):
                errors[str(meta.get("client_name", "?"))] = str(meta[META_SITE_ERROR])
        return {**errors, **{s: why for s, why in self._task_failures.items() if s not in errors}}

    def fail_job(self, reason: str) -> None:
        """End the job as failed: log ``reason`` and raise NVFlare's fatal system error (the job's
        status becomes an execution exception; ``nvflare simulator`` exits non-zero)."""
        if self.failure is None:
            self.failure = reason
            self.panic(f"fedweigh job failed: {reason}")

    def _out_dir(self) -> Path:
        return Path(self.get_app_dir())

    def _save_state(
        self, out_dir: Path, round_index: int, backend: AggregationBackend, rows: list[dict]
    ) -> None:
        """The run state after ``round_index``: scheme state and rows (JSON), the global model (npz;
        under HE the ciphertext, the server never writes a plaintext model then). JSON last."""
        state = {
            "round": round_index,
            "num_rounds": self.num_rounds,
            "budget_id": self._budget_id,
            "scheme": self.scheme,
            "scheme_args": self.scheme_args,
            "scheme_state": self._scheme.state_dict(),
            "rows": rows,
        }
        if backend.encrypted:
            backend.save(out_dir / HE_GLOBAL_NPZ)  # type: ignore[attr-defined]
        else:
            atomic_write_npz(out_dir / GLOBAL_NPZ, **backend.task_params())
        atomic_write_text(out_dir / STATE_JSON, json.dumps(state))

    def _load_state(self, folder: str) -> tuple[int, Params, list[dict]]:
        path = Path(folder) / STATE_JSON
        if not path.is_file():
            raise FileNotFoundError(f"resume_from={folder}: no {STATE_JSON} there")
        state = json.loads(path.read_text())
        if state.get("scheme") != self.scheme:
            raise ValueError(
                f"resume_from={folder}: state is for scheme {state.get('scheme')!r}, not {self.scheme!r}"
            )
        if self.he:  # the encrypted global model is restored with the backend
            if not (Path(folder) / HE_GLOBAL_NPZ).is_file():
                raise FileNotFoundError(f"resume_from={folder}: he=True but there is no {HE_GLOBAL_NPZ}")
            params: Params = {}
        else:
            with np.load(Path(folder) / GLOBAL_NPZ) as npz:
                params = {k: npz[k] for k in npz.files}
        self._scheme.load_state_dict(state.get("scheme_state") or {})
        if state.get("budget_id"):
            self._budget_id = str(state["budget_id"])
        else:
            self.warning(f"resume_from={folder}: the state names no privacy budget; DP budgets start anew")
        return int(state["round"]), params, list(state.get("rows", []))

    def _backend(self, initial: Params) -> AggregationBackend:
        """Plaintext theta_g, or under HE the server's encrypted global model (restored on resume)."""
        if not self.he:
            return PlaintextBackend(initial)
        from fedweigh.server.encrypted import EncryptedGlobalModel

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

    def _probe(self) -> ModelProbe | None:
        """The server's probe of candidate global models: the persistor's model with a fixed
        synthetic batch (:class:`~fedweigh.server.model_check.ModelProbe`); None under HE (the server
        holds no plaintext model) or when the persistor holds no model of a known input shape."""
        model = getattr(self.persistor, "model", None)
        if self.he or model is None:
            return None
        try:
            return ModelProbe(model)
        except (ValueError, TypeError, RuntimeError) as e:
            self.info(f"candidate global models get the array checks only, no probe batch: {e}")
            return None

    # -- the workflow --------------------------------------------------------------------------
    def run(self) -> None:
        out_dir = self._out_dir()
        self.fl_ctx.set_prop(AppConstants.NUM_ROUNDS, self.num_rounds, private=True, sticky=False)
        start_round, rows = 1, []
        self._budget_id = str(self.fl_ctx.get_job_id() or "job")
        model = self.load_model()
        # the persistor's torch model names its buffers exactly (else the scheme's name rule applies)
        use_model_buffers(self._scheme, getattr(self.persistor, "model", None))
        if self.resume_from:
            last, params, rows = self._load_state(self.resume_from)
            if not self.he:  # under HE the values come from the HE state, names and shapes from the model
                model = FLModel(params_type=ParamsType.FULL, params=params)
            start_round = last + 1
            self.info(f"resuming from {self.resume_from} after round {last}")
        all_sites = [c.name for c in self.engine.get_clients()]
        floor = server_floor(self.min_secure_sum, len(all_sites))
        announced = AnnouncedCounts()  # N_k as the sites announce it in the statistics phase
        step = RoundStep(
            self._scheme,
            self._backend(to_numpy_dict(model.params)),
            num_rounds=self.num_rounds,
            safeguards=replace(
                self._safeguards,
                min_secure_sum=floor,
                declared_sizes=combine_declarations(self._job_declaration(), server_declaration()),
                source=_SOURCE,
            ),
            announced=announced,
            probe=self._probe(),
            log=self.warning,
        )
        # the rows' scalars leave as NVFlare analytics events (the job's receivers: TensorBoard,
        # MLflow, W&B), not through a TensorBoard writer of the controller's own
        recorder = RoundRecorder(out_dir, self.scheme, rows, sinks=[ServerAnalytics(self)], tensorboard=False)
        plan = {**step.plan(self.scheme, self.scheme_args), "budget_id": self._budget_id}
        self.info(f"privacy budget id {self._budget_id!r}; secure sums need at least {floor} contributions")
        tasks = NVFlareTasks(self, all_sites, out_dir)
        if self.statistics != "none" and (
            self._scheme.needs_global_histogram or self.loss_needs_global_stats
        ):
            collected = run_statistics_phase(self, sorted(all_sites), self.statistics, floor, plan)
            tasks.note_refusals({"client_name": s, **m} for s, m in collected.items() if isinstance(m, dict))
            for site, meta in collected.items():
                if isinstance(meta, dict):
                    announced.note(site, meta.get(META_NUM_SAMPLES))
            if self.failure or not tasks.enough_sites():
                recorder.close()
                return
        settings = LoopSettings(
            self.sample_fraction, self.seed, start_round, evaluate_final=self.evaluate_final
        )
        run_rounds(step, tasks, recorder, plan, settings, log=self.info)
        if tasks.rounds_run and not tasks.rounds_updated and self.failure is None:
            self.fail_job(
                f"none of the {tasks.rounds_run} round(s) of this run updated the global model; last round: "
                + (tasks.last_reasons or "no site sent a result")
            )
        for path in recorder.plot():
            self.info(f"wrote {path}")
        recorder.close()
        self.info(f"metrics: {out_dir}")


class NVFlareTasks(Transport):
    """The round loop's NVFlare transport (:class:`fedweigh.server.loop.Transport`) for one run of
    :class:`FedweighController`.

    Tasks go out through the controller's :meth:`~FedweighController.ask_sites` (``train_timeout``);
    each round sets NVFlare's round properties and fires its round events; a round that changed the
    global model is persisted (the job's persistor, in plaintext) with the run state, and every
    ``memory_gc_rounds`` rounds the memory is returned to the system. Sites that refuse the job under
    their site policy take no further part; the run ends with a fatal error when fewer than
    ``min_clients`` remain. ``stop_after`` and NVFlare's abort signal end the run early.
    """

    def __init__(self, controller: FedweighController, sites: list[str], out_dir: Path):
        self.controller = controller
        self.sites = list(sites)
        self.out_dir = out_dir
        #: sites that refused the whole job under their site policy, with the reason
        self.refused: dict[str, str] = {}
        self._targets: list[str] = []  # the sites of the round under way
        #: the sites whose script failed on this round's task (their error), and those that answered
        self._errors: dict[str, str] = {}
        self._answered: set[str] = set()
        #: rounds run and rounds that updated the global model in this run; the last round's reasons
        self.rounds_run = 0
        self.rounds_updated = 0
        self.last_reasons = ""

    # -- the site policies' refusals ---------------------------------------------------------------
    def note_refusals(self, metas) -> None:
        """Log every site that refuses a task under its site policy (``metas``: the results' meta);
        remember whole-job refusals."""
        c = self.controller
        for meta in metas:
            if not isinstance(meta, dict) or not meta.get(META_REFUSED):
                continue
            site = str(meta.get("client_name", "?"))
            reason = str(meta.get(META_REFUSED))
            if meta.get(META_REFUSED_JOB):
                if site not in self.refused:
                    c.error(f"{site} refuses this job under its site policy: {reason}")
                self.refused[site] = reason
            else:
                c.warning(f"{site} refuses this task under its site policy: {reason}")

    def enough_sites(self) -> bool:
        """False (after ending the run with a fatal error naming the refusals) when the sites that
        refused the job leave fewer than ``min_clients``."""
        c = self.controller
        if len(self.site_names()) >= c.min_clients:
            return True
        reasons = "; ".join(f"{s}: {why}" for s, why in sorted(self.refused.items()))
        c.panic(
            f"only {len(self.site_names())} site(s) take part, fewer than min_clients={c.min_clients}: "
            f"refused by site policy: {reasons}"
        )
        return False

    # -- the tasks -----------------------------------------------------------------------------------
    def site_names(self) -> list[str]:
        return [s for s in self.sites if s not in self.refused]

    def train(self, task: TrainTask) -> list[ClientResult]:
        c = self.controller
        self._targets = list(task.targets)
        model = FLModel(
            params_type=ParamsType.FULL,
            params=task.params,
            current_round=task.round_index - 1,  # NVFlare counts rounds from 0
            total_rounds=task.num_rounds,
            meta={META_PLAN: dict(task.plan), **task.meta},
        )
        results = c.ask_sites(TASK_TRAIN, model, task.targets, c.min_clients)
        self.note_refusals(r.meta for r in results)
        self._errors = self.note_errors(results, f"round {task.round_index}")
        self._answered = {str((r.meta or {}).get("client_name", "?")) for r in results} | set(self._errors)
        return [client_result(r) for r in results]

    def note_errors(self, results: list[FLModel], where: str) -> dict[str, str]:
        """Log every site's error on a task and every HE site that refused the model it decrypted;
        returns the errors by site."""
        c = self.controller
        for r in results:
            meta = r.meta if isinstance(r.meta, dict) else {}
            if meta.get(META_HE_REFUSED):
                c.warning(f"{where}: {meta[META_HE_REFUSED]}")
        errors = c.site_errors(results)
        for site, why in errors.items():
            c.error(f"{where}: {site} failed: {why}")
        return errors

    def validate(self, task: ValidateTask) -> list[dict]:
        # under HE this task delivers theta_g^T to the sites
        final = FLModel(
            params_type=ParamsType.FULL,
            params=task.params,
            current_round=task.num_rounds,
            meta=dict(task.meta),
        )
        results = self.controller.ask_sites(TASK_VALIDATE, final, task.targets, 1)
        self.note_refusals(r.meta for r in results)
        self.note_errors(results, "final validation")
        ok = [
            r
            for r in results
            if isinstance(r.meta, dict) and r.metrics and r.meta.get(META_NUM_SAMPLES) is not None
        ]
        ok.sort(key=lambda r: str((r.meta or {}).get("client_name", "")))  # site order, as each round
        return [r.metrics or {} for r in ok]

    # -- around each round -------------------------------------------------------------------------
    def stop_before(self, round_index: int) -> bool:
        c = self.controller
        if c.stop_after is None or round_index <= c.stop_after:
            return False
        c.info(
            f"stopping after round {c.stop_after} as configured; continue this run with "
            f"resume_from={str(self.out_dir)!r}"
        )
        return True

    def aborted(self) -> bool:
        return bool(self.controller.abort_signal and self.controller.abort_signal.triggered)

    def round_started(self, round_index: int, backend: AggregationBackend) -> None:
        """NVFlare's round bookkeeping, as its ``FedAvg`` does: the round (0-based) and, in plaintext,
        the global model the sites receive in the context, then ``ROUND_STARTED``."""
        c = self.controller
        c.fl_ctx.set_prop(AppConstants.CURRENT_ROUND, round_index - 1, private=True, sticky=False)
        if not backend.encrypted:
            learnable = FLModelUtils.to_model_learnable(
                FLModel(params_type=ParamsType.FULL, params=backend.task_params())
            )
            c.fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, learnable, private=True, sticky=True)
        c.event(AppEventType.ROUND_STARTED)

    def before_aggregation(self, round_index: int) -> None:
        self.controller.event(AppEventType.BEFORE_AGGREGATION)

    def after_aggregation(self, round_index: int, outcome: RoundOutcome) -> bool:
        """``AFTER_AGGREGATION`` with the aggregate; the sites that refused the job are recorded as left
        out; False when too few sites remain."""
        c = self.controller
        for site, reason in self.refused.items():
            if site not in self._targets:
                outcome.excluded.setdefault(site, f"{site} refused the job: {reason}")
        self.rounds_run += 1
        self.rounds_updated += int(bool(outcome.updated))
        self.last_reasons = "; ".join(str(why) for why in outcome.excluded.values())
        if not outcome.updated and self._errors and self._answered <= set(self._errors):
            first, why = next(iter(self._errors.items()))
            c.fail_job(
                f"round {round_index} ended with no valid result: every site that answered failed "
                f"({len(self._errors)} of {len(self._targets)}); first error, {first}: {why}"
            )
            return False
        aggregated = FLModel(
            params_type=ParamsType.FULL, params=outcome.params or {}, metrics=outcome.metrics
        )
        c.fire_event_with_data(
            AppEventType.AFTER_AGGREGATION, c.fl_ctx, AppConstants.AGGREGATION_RESULT, aggregated
        )
        return self.enough_sites()

    def free_memory(self, round_index: int) -> None:
        every = self.controller.memory_gc_rounds
        if every and round_index % every == 0:
            cleanup_memory()

    def round_values(self) -> dict[str, float]:
        return _server_memory_mb()

    def round_saved(self, round_index: int, backend: AggregationBackend, rows: list[dict]) -> None:
        """The global model to the job's persistor (plaintext only: under HE there is none) and the run
        state to the app folder."""
        c = self.controller
        if not backend.encrypted:
            c.save_model(
                FLModel(
                    params_type=ParamsType.FULL,
                    params=backend.task_params(),
                    current_round=round_index - 1,
                    total_rounds=c.num_rounds,
                )
            )
        c._save_state(self.out_dir, round_index, backend, rows)
