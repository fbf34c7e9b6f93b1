"""One site's local work — data, model, loss, training, evaluation — without NVFlare.

The NVFlare client script (:mod:`fedweigh.flare.client`) and the in-process benchmark both drive a
:class:`SiteTrainer`, so the two can never train differently.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from fedweigh.arrays import to_numpy_dict
from fedweigh.data.base import LabeledImages, SiteData
from fedweigh.histograms import GlobalStats
from fedweigh.losses import LossContext, build_loss
from fedweigh.models import build_model
from fedweigh.secure.accountant import dp_state_path
from fedweigh.secure.dp_config import LOCAL_JOB_ID
from fedweigh.secure.dp_sgd import DPSGD, DPRoundReport
from fedweigh.secure.stats_release import HistogramReleaser, ReleasedHistogram
from fedweigh.site.args import ClientArgs, ineffective_options
from fedweigh.site.policy import PERMISSIVE_DEFAULT, SitePolicy
from fedweigh.site.scalars import MODEL_SCALARS, plan_scalars, wanted_scalars
from fedweigh.train import (
    TrainResult,
    evaluate,
    get_params,
    make_optimizer,
    resolve_device,
    set_params,
    to_memory_format,
    train_local,
)
from fedweigh.weighting.base import ScalarContext

logger = logging.getLogger("fedweigh.site")

__all__ = ["RoundOutput", "SiteTrainer", "build_site_model", "round_seed", "warn_ineffective"]

#: The no-effect warnings this process gave already (each is logged once, not once per site).
_WARNED: set[str] = set()


def warn_ineffective(args: ClientArgs, device: str) -> None:
    """Log a warning, once per process, for every setting of ``args`` that has no effect on ``device``
    (:func:`fedweigh.site.args.ineffective_options`)."""
    for reason in ineffective_options(args, device):
        if reason not in _WARNED:
            _WARNED.add(reason)
            logger.warning("%s", reason)


def build_site_model(args: ClientArgs, data: LabeledImages) -> torch.nn.Module:
    """The model ``args`` names (arch, norm, seed, pretrained), shaped for ``data`` (classes, channels,
    size), on ``args.device`` in ``args.channels_last`` memory format."""
    model = build_model(
        args.arch,
        num_classes=data.num_classes,
        in_channels=int(data.images.shape[1]),
        img_size=int(data.images.shape[-1]),
        norm=args.norm,
        seed=args.seed,
        pretrained=args.pretrained,
    )
    return to_memory_format(model.to(resolve_device(args.device)), args.channels_last)


class SiteTrainer:
    """A site's data, model and loss, and the local work of one round.

    Args:
        site: the site's train/val splits.
        test: the test set the global model is scored on (the global test set in simulation).
        args: model, loss and local-training settings.
        threads: torch intra-op threads for this site (None = leave torch's setting).
        job_id: the NVFlare job this trainer serves; names the per-job files of the site (DP-SGD
            account, released label statistics). The default, ``"local"`` (in-process runs), keeps
            them in memory only. The NVFlare client sets it to the privacy budget id the server
            announces (the first job's id, kept across ``resume_from``).
        privacy_guard: the site policy's epsilon caps (:class:`fedweigh.site.policy.PrivacyGuard`), given
            to DP-SGD and the statistics release; None: no caps beyond the job's own.
        policy: the site's policy; its ``statistics_epsilon`` noises the label statistics when the job
            sets no ``stats_dp_epsilon``. None: the guard's policy, else the permissive default (whose
            statistics epsilon is 1.0 too: private by default, in simulation as well).
        release_seed: the benchmark's reproducible statistics noise (drawn from ``release_seed`` and the
            site's name, so that a cell is the same in any process); None (every NVFlare client): noise
            from the OS, never from a seed the server knows.
    """

    def __init__(
        self,
        site: SiteData,
        test: LabeledImages,
        args: ClientArgs,
        threads: int | None = None,
        job_id: str = LOCAL_JOB_ID,
        privacy_guard=None,
        policy: SitePolicy | None = None,
        release_seed: int | None = None,
    ):
        self.site_name = site.name
        self.site = site
        self.test = test
        self.args = args
        if threads:
            torch.set_num_threads(threads)
        train: LabeledImages = site.train
        self.device = resolve_device(args.device)
        warn_ineffective(args, self.device)
        self.model = build_site_model(args, train)
        #: what trains: the model, or its torch.compile'd wrapper (same parameters)
        self.train_model: torch.nn.Module = torch.compile(self.model) if args.compile else self.model
        #: the local optimizer kept across rounds (``args.keep_optimizer``; built on the first round)
        self.optimizer: torch.optim.Optimizer | None = None
        self.class_counts = train.label_histogram()
        #: The federation's label statistics from the statistics phase (None before it, or without it).
        self.global_stats: GlobalStats | None = None
        self.privacy_guard = privacy_guard
        if policy is None:
            policy = getattr(privacy_guard, "policy", None) or PERMISSIVE_DEFAULT
        #: the site policy the statistics release follows (its ``statistics_epsilon``)
        self.policy: SitePolicy = policy
        self.release_seed = release_seed
        self._warned_empty_histogram = False
        #: The once-per-job release of this site's label histogram: noised with the job's
        #: ``stats_dp_epsilon``, else the policy's ``statistics_epsilon``; exact only when both are None.
        self.releaser = HistogramReleaser(
            args.stats_dp_config(policy.statistics_epsilon), self.site_name, job_id, guard=privacy_guard
        )
        #: The global model this site received in its previous training round (FedDRAW's
        #: similarity="direction" compares its update with the global update since then).
        self.previous_global: dict[str, np.ndarray] | None = None
        #: DP-SGD across the rounds of the job (built on the first DP round), and what the last round spent.
        self.dp_sgd: DPSGD | None = None
        self.dp_report: DPRoundReport | None = None
        logger.info(
            "%s: %d train / %d val images, %d test, %d classes",
            site.name,
            len(train),
            len(site.val),
            len(test),
            train.num_classes,
        )

    @property
    def job_id(self) -> str:
        """The NVFlare job this trainer serves (names the per-job files and caches of the site)."""
        return self.releaser.job_id

    @job_id.setter
    def job_id(self, value: str) -> None:
        if str(value) != self.releaser.job_id:  # another job: its own release, drawn afresh
            self.releaser = HistogramReleaser(
                self.releaser.config, self.site_name, str(value), guard=self.privacy_guard
            )

    @property
    def num_train(self) -> int:
        """N_k: the site's training-set size."""
        return len(self.site.train)

    def released_statistics(self) -> ReleasedHistogram:
        """What this site may reveal of its label histogram: exact, or this job's one noised release.

        Used by the statistics phase and for the scheme's client scalars (post-processing of the
        same release, so no further budget is spent).
        """
        train = self.site.train
        rng = None
        if self.release_seed is not None:  # the benchmark's reproducible draw (class docstring)
            rng = np.random.default_rng([int(self.release_seed), zlib.crc32(self.site_name.encode())])
        return self.releaser.release(self.class_counts, len(train), train.task, rng)

    def make_loss(self):
        """The configured loss, built from this site's (and, if known, the global) label statistics."""
        if self.args.loss in ("default", "bce", "ce") and not self.args.loss_options:
            return None  # the training module's default (BCE / CE)
        counts, n = self.class_counts, len(self.site.train)
        if self.args.dp_sgd:
            # DP-SGD's guarantee holds for a loss fixed before training: one built from the exact
            # histogram would let every sample's label reach the update outside the clipping
            release = self.released_statistics()
            if release.epsilon is None:
                raise ValueError(
                    f"{self.site_name}: the loss {self.args.loss!r} is built from the label histogram, and under "
                    "DP-SGD it may only use the privatised one: set stats_dp_epsilon (statistics DP) as well"
                )
            counts, n = np.asarray(release.class_counts), release.num_samples
        ctx = LossContext.of_site(
            self.site.train.task, self.site.train.num_classes, counts, n, global_stats=self.global_stats
        )
        return build_loss(self.args.loss, ctx, **self.args.loss_options)

    def evaluate(self) -> dict[str, float]:
        """Metrics of the current model on the local validation split (``val_*``) and the test set (``test_*``)."""
        metrics = {f"val_{k}": v for k, v in evaluate(self.model, self.site.val).items()}
        if self.args.eval_test:
            metrics.update({f"test_{k}": v for k, v in evaluate(self.model, self.test).items()})
        return metrics

    def train(
        self, global_params: dict | None, fedprox_mu: float, round_seed: int, total_rounds: int | None = None
    ) -> TrainResult:
        """Local training of one round; with DP-SGD on (``args.dp_*``) through :class:`fedweigh.secure.dp_sgd.DPSGD`.

        Under DP-SGD the epsilon spent so far is kept in ``self.dp_report`` (None otherwise), and
        ``total_rounds`` (the job's planned rounds) spreads a target epsilon over the whole job.
        """
        cfg = self.args.train_config(fedprox_mu=fedprox_mu, seed=round_seed, device=self.device)
        dp_config = self.args.dp_config()
        self.dp_report = None
        if dp_config is None:
            if self.args.keep_optimizer and self.optimizer is None:
                self.optimizer = make_optimizer(self.model, cfg)
            return train_local(
                self.train_model,
                self.site.train,
                cfg,
                loss_fn=self.make_loss(),
                global_params=global_params,
                optimizer=self.optimizer,
            )
        if self.dp_sgd is None or self.dp_sgd.config != dp_config:
            path = None if self.job_id == LOCAL_JOB_ID else dp_state_path(self.job_id, self.site_name)
            self.dp_sgd = DPSGD(dp_config, path, site_name=self.site_name, guard=self.privacy_guard)
        result, self.dp_report = self.dp_sgd.train_round(
            self.model, self.site.train, cfg, self.make_loss(), global_params, total_rounds=total_rounds
        )
        return result

    def scheme_scalars(self, plan: dict, params: dict, global_params: dict) -> dict[str, float]:
        """The scalars the server's scheme asked for, computed by :func:`fedweigh.site.scalars.plan_scalars`
        (the scheme's own code, with the model's exact buffers, as the server's)."""
        wanted = wanted_scalars(plan)
        if not wanted:  # only what the plan asks for, never more
            return {}
        if set(wanted) <= set(MODEL_SCALARS):  # nothing of the histogram is reported: no release, no budget
            release = ReleasedHistogram(self.class_counts, self.num_train, None, None)
        else:
            release = self.released_statistics()  # the noised release when statistics DP is on
        if not np.any(np.asarray(release.class_counts) > 0) and not self._warned_empty_histogram:
            self._warned_empty_histogram = True  # once per job: the histogram does not change
            logger.warning(
                "%s: its training labels have no positive for any class (empty label histogram); "
                "scheme %r gives it its empty-histogram score",
                self.site_name,
                plan["scheme"],
            )
        ctx = ScalarContext(
            class_counts=np.asarray(release.class_counts),
            num_samples=release.num_samples,
            global_stats=self.global_stats,
            params=params,
            global_params=global_params,
            previous_global=self.previous_global,
        )
        return plan_scalars(plan, ctx, model=self.model, who=self.site_name)

    def run_round(
        self,
        global_params: dict,
        round_index: int,
        plan: dict | None = None,
        total_rounds: int | None = None,
        evaluate_received: bool = True,
    ) -> RoundOutput:
        """Evaluate the received global model, train on it, and report what the scheme needs.

        ``plan`` is what the server sends with the task: ``scheme``, ``scheme_args``, ``scalars`` (the
        names the scheme needs from clients) and ``fedprox_mu``. ``total_rounds`` (the job's planned
        rounds, NVFlare's ``FLModel.total_rounds``; or ``plan["total_rounds"]``) is needed by DP-SGD with
        a target epsilon; under DP-SGD the metrics carry ``dp_epsilon``, the epsilon spent so far.
        ``evaluate_received=False`` skips the evaluation of the received model (the bench evaluates
        every k rounds).
        """
        plan = plan or {}
        set_params(self.model, global_params)
        metrics = self.evaluate() if evaluate_received else {}
        global_np = to_numpy_dict(global_params)
        mu = float(plan.get("fedprox_mu", 0.0) or 0.0)
        prox = {k: torch.as_tensor(v) for k, v in global_np.items()} if mu > 0 else None
        if total_rounds is None:
            total_rounds = plan.get("total_rounds")
        result = self.train(
            prox, mu, round_seed(self.args.seed, self.site_name, round_index), total_rounds=total_rounds
        )
        params = get_params(self.model)
        scalars = self.scheme_scalars(plan, params, global_np) if plan.get("scheme") else {}
        self.previous_global = global_np
        return RoundOutput(
            params=params,
            num_steps=result.num_steps,
            num_samples=len(self.site.train),  # N_k: the site's training-set size, as FedAvg weighs it
            metrics={
                **metrics,
                # the training loss is computed from the private training data: under DP-SGD it stays here
                **({"train_loss": result.mean_loss} if self.dp_report is None else {}),
                **(self.dp_report.metrics() if self.dp_report is not None else {}),
            },
            scalars=scalars,
        )


@dataclass
class RoundOutput:
    """What a site sends back after a round of local training."""

    params: dict[str, np.ndarray]
    num_steps: int
    num_samples: int
    metrics: dict[str, float]
    scalars: dict[str, float]


def round_seed(base: int, site_name: str, round_index: int) -> int:
    """A per-site, per-round seed so shuffling differs across rounds but runs are reproducible."""
    return (base * 1_000_003 + sum(map(ord, site_name)) * 7919 + round_index) % (2**31 - 1)
