"""Differential privacy for a site: DP-SGD on its model updates and the Gaussian mechanism on its label statistics.

Two independent mechanisms, each with its own (epsilon, delta) budget (they compose: a site that uses
both has spent at most the sum of the epsilons and the sum of the deltas):

**DP-SGD** (Abadi et al., CCS 2016), with Opacus (Yousefpour et al., 2021): every optimizer step
clips each sample's gradient to L2 norm ``max_grad_norm`` (C), sums the clipped gradients, adds
N(0, (sigma C)^2 I) and divides by the expected batch size; batches are drawn by Poisson sampling
with rate q = 1 / ceil(N_k / B). The privacy accountant (RDP, Mironov 2017, or PRV, Gopi et al.
2021) turns the history of (sigma, q, steps) into the epsilon spent. With a target epsilon,
sigma is computed once, for the whole job (rounds x steps per round), so that the planned last
round ends at or just under the target (:func:`opacus.accountants.utils.get_noise_multiplier`).
:class:`DPSGD` keeps the accountant across rounds and, in an NVFlare job, in a JSON file in the
client's working directory, so a relaunched client process continues the same account.

**Label statistics** (:func:`privatize_histogram`): the Gaussian mechanism on a site's histogram
(positives per class and N_k) before it is encrypted or sent. Adjacent datasets differ in one
patient's image (added, removed or replaced). L2 sensitivity: multi-label sqrt(C + 1) (one image
moves each of its up to C positive findings by 1 and N_k by 1); multi-class sqrt(2) (a replaced
image moves two class counts by 1; an added or removed one moves one count, and N_k is the sum of
the counts). Sigma comes from (epsilon, delta) by the analytic Gaussian mechanism (Balle and Wang,
ICML 2018) or the classic bound sigma = Delta sqrt(2 ln(1.25 / delta)) / epsilon (Dwork and Roth,
2014, Thm. A.1, epsilon < 1). Rounding, clipping at 0 and at N_k, and everything derived from the
noised histogram (DAFL's N_k c_k, the scalars a scheme asks for, the global histogram) are
post-processing and cost no further budget.

No NVFlare import: the client script and the in-process benchmark both use this module.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import secrets
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedweigh.data.base import LabeledImages
from fedweigh.train import (
    MaskedBCEWithLogitsLoss,
    TrainConfig,
    TrainResult,
    default_loss,
    make_loader,
    make_optimizer,
    run_epochs,
)

logger = logging.getLogger("fedweigh.privacy")

#: Per-sample gradient implementations: fedweigh's own layer hooks ("fast"), and Opacus' modes.
DP_MODES: tuple[str, ...] = ("auto", "fast", "hooks", "functorch", "ghost")
ACCOUNTANTS: tuple[str, ...] = ("rdp", "prv")
STATS_MECHANISMS: tuple[str, ...] = ("analytic", "classic")
#: File (in the client's working directory) that keeps a site's DP-SGD accountant for a job.
DP_STATE_FILE = "fedweigh_dp_sgd_{job_id}_{site}.json"
#: File that keeps a site's noised label statistics for a job (released once, reused on relaunch).
STATS_RELEASE_FILE = "fedweigh_stats_dp_{job_id}_{site}.json"
#: The job id of in-process runs (``SiteTrainer.job_id`` default): nothing is persisted for it.
LOCAL_JOB_ID = "local"
_STATE_FORMAT = 1


class PrivacyBudgetExhausted(RuntimeError):
    """Training another round would spend more than the site's DP-SGD budget."""


# ============================================================================ configuration
@dataclass
class DPConfig:
    """DP-SGD settings of a job.

    Exactly one of ``epsilon`` (the TOTAL budget over the job's planned rounds; the noise multiplier
    is derived from it) and ``noise_multiplier`` (sigma, fixed; epsilon then only grows with the
    steps taken) must be given.

    Args:
        epsilon: target epsilon for the whole job.
        delta: target delta; choose it below 1 / N_k (e.g. 1e-5 for sites of up to ~10^4 images).
        max_grad_norm: per-sample L2 clipping bound C.
        noise_multiplier: sigma, the noise std divided by C.
        accountant: ``"rdp"`` (Renyi DP) or ``"prv"`` (privacy random variables; tighter).
        mode: per-sample gradient implementation: ``"fast"`` (fedweigh's layer hooks, Conv2d/Linear/
            GroupNorm/InstanceNorm2d models), ``"hooks"``, ``"functorch"`` or ``"ghost"`` (Opacus'),
            or ``"auto"``: ``"fast"`` when the model has only supported layers, else ``"hooks"``.
    """

    epsilon: float | None = None
    delta: float = 1e-5
    max_grad_norm: float = 1.0
    noise_multiplier: float | None = None
    accountant: str = "rdp"
    mode: str = "auto"

    def __post_init__(self) -> None:
        if (self.epsilon is None) == (self.noise_multiplier is None):
            raise ValueError(
                "DPConfig: give exactly one of epsilon (total budget) and noise_multiplier, got "
                f"epsilon={self.epsilon}, noise_multiplier={self.noise_multiplier}"
            )
        if self.epsilon is not None and not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"DPConfig.epsilon must be a positive finite number, got {self.epsilon}")
        if self.noise_multiplier is not None and not (
            self.noise_multiplier > 0 and math.isfinite(self.noise_multiplier)
        ):
            raise ValueError(f"DPConfig.noise_multiplier must be > 0, got {self.noise_multiplier}")
        if not 0 < self.delta < 1:
            raise ValueError(f"DPConfig.delta must be in (0, 1), got {self.delta}")
        if not (self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)):
            raise ValueError(f"DPConfig.max_grad_norm must be > 0, got {self.max_grad_norm}")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"DPConfig.accountant must be one of {ACCOUNTANTS}, got {self.accountant!r}")
        if self.mode not in DP_MODES:
            raise ValueError(f"DPConfig.mode must be one of {DP_MODES}, got {self.mode!r}")

    @classmethod
    def from_args(cls, args: Any) -> DPConfig | None:
        """The DP-SGD settings in a ``ClientArgs`` (``dp_*`` fields), or None when DP-SGD is off."""
        epsilon = getattr(args, "dp_epsilon", None)
        sigma = getattr(args, "dp_noise_multiplier", None)
        if epsilon is None and sigma is None:
            return None
        return cls(
            epsilon=epsilon,
            delta=getattr(args, "dp_delta", 1e-5),
            max_grad_norm=getattr(args, "dp_max_grad_norm", 1.0),
            noise_multiplier=sigma,
            accountant=getattr(args, "dp_accountant", "rdp"),
            mode=getattr(args, "dp_mode", "auto"),
        )


@dataclass
class StatsDPConfig:
    """Gaussian noise on a site's label statistics: one release with budget (epsilon, delta).

    ``mechanism``: ``"analytic"`` (Balle and Wang 2018, exact, any epsilon) or ``"classic"``
    (sigma = Delta sqrt(2 ln(1.25/delta)) / epsilon, only for epsilon < 1).
    """

    epsilon: float
    delta: float = 1e-5
    mechanism: str = "analytic"

    def __post_init__(self) -> None:
        if not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"StatsDPConfig.epsilon must be a positive finite number, got {self.epsilon}")
        if not 0 < self.delta < 1:
            raise ValueError(f"StatsDPConfig.delta must be in (0, 1), got {self.delta}")
        if self.mechanism not in STATS_MECHANISMS:
            raise ValueError(
                f"StatsDPConfig.mechanism must be one of {STATS_MECHANISMS}, got {self.mechanism!r}"
            )
        if self.mechanism == "classic" and self.epsilon >= 1:
            raise ValueError(
                f"StatsDPConfig: the classic Gaussian bound holds only for epsilon < 1, got {self.epsilon}; "
                "use mechanism='analytic'"
            )

    @classmethod
    def from_args(cls, args: Any) -> StatsDPConfig | None:
        """The statistics-DP settings in a ``ClientArgs`` (``stats_dp_*``), or None when off."""
        epsilon = getattr(args, "stats_dp_epsilon", None)
        if epsilon is None:
            return None
        return cls(
            epsilon=epsilon,
            delta=getattr(args, "stats_dp_delta", 1e-5),
            mechanism=getattr(args, "stats_dp_mechanism", "analytic"),
        )


# ============================================================================ Gaussian mechanism
def classic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """sigma = Delta sqrt(2 ln(1.25 / delta)) / epsilon (Dwork and Roth 2014, Thm. A.1; epsilon in (0, 1))."""
    if not 0 < epsilon < 1:
        raise ValueError(f"classic_gaussian_sigma: the bound needs 0 < epsilon < 1, got {epsilon}")
    if not 0 < delta < 1 or sensitivity <= 0:
        raise ValueError(
            f"classic_gaussian_sigma: need 0 < delta < 1 and sensitivity > 0, got {delta}, {sensitivity}"
        )
    return sensitivity * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def gaussian_delta(sigma: float, epsilon: float, sensitivity: float) -> float:
    """The exact delta(epsilon) of the Gaussian mechanism N(f(x), sigma^2 I) with L2 sensitivity Delta.

    delta = Phi(Delta / (2 sigma) - epsilon sigma / Delta) - e^epsilon Phi(-Delta / (2 sigma) - epsilon sigma / Delta)
    (Balle and Wang, ICML 2018, Thm. 8); the second term is evaluated in log space.
    """
    from scipy.special import log_ndtr, ndtr

    if sigma <= 0 or sensitivity <= 0:
        raise ValueError(f"gaussian_delta: sigma and sensitivity must be > 0, got {sigma}, {sensitivity}")
    a = sensitivity / (2.0 * sigma)
    b = epsilon * sigma / sensitivity
    return float(max(0.0, ndtr(a - b) - math.exp(epsilon + float(log_ndtr(-a - b)))))


@functools.lru_cache(maxsize=256)
def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """The smallest sigma with :func:`gaussian_delta` <= delta (analytic Gaussian mechanism, Balle and Wang 2018).

    Bisection on sigma (delta(sigma) decreases in sigma) to a relative width of 1e-12; returns the
    upper end, so the guarantee holds.
    """
    if not (epsilon > 0 and math.isfinite(epsilon)) or not 0 < delta < 1 or sensitivity <= 0:
        raise ValueError(
            "analytic_gaussian_sigma: need epsilon > 0, 0 < delta < 1 and sensitivity > 0, got "
            f"{epsilon}, {delta}, {sensitivity}"
        )
    hi = sensitivity
    while gaussian_delta(hi, epsilon, sensitivity) > delta:
        hi *= 2.0
    lo = 0.0
    while hi - lo > 1e-12 * hi:
        mid = 0.5 * (lo + hi)
        if gaussian_delta(mid, epsilon, sensitivity) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def gaussian_sigma(epsilon: float, delta: float, sensitivity: float, mechanism: str = "analytic") -> float:
    """Noise std for an (epsilon, delta)-DP Gaussian mechanism: ``"analytic"`` or ``"classic"``."""
    if mechanism == "analytic":
        return analytic_gaussian_sigma(epsilon, delta, sensitivity)
    if mechanism == "classic":
        return classic_gaussian_sigma(epsilon, delta, sensitivity)
    raise ValueError(f"gaussian_sigma: mechanism must be one of {STATS_MECHANISMS}, got {mechanism!r}")


# ============================================================================ DP on label statistics
def histogram_sensitivity(num_classes: int, task: str) -> float:
    """L2 sensitivity of a site's released histogram to one image: sqrt(C + 1) multi-label, sqrt(2) multi-class."""
    if num_classes < 1:
        raise ValueError(f"histogram_sensitivity: num_classes must be >= 1, got {num_classes}")
    if task == "multilabel":
        return math.sqrt(num_classes + 1.0)
    if task == "multiclass":
        return math.sqrt(2.0)
    raise ValueError(f"histogram_sensitivity: task must be 'multilabel' or 'multiclass', got {task!r}")


@dataclass
class HistogramRelease:
    """A site's noised label statistics, released once per job, and the mechanism behind them."""

    class_counts: np.ndarray
    num_samples: int
    epsilon: float
    delta: float
    sigma: float
    sensitivity: float
    mechanism: str
    task: str

    def as_dict(self) -> dict:
        return {
            **{k: v for k, v in asdict(self).items() if k != "class_counts"},
            "class_counts": [int(x) for x in self.class_counts],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HistogramRelease:
        return cls(
            class_counts=np.asarray(d["class_counts"], dtype=np.int64),
            num_samples=int(d["num_samples"]),
            epsilon=float(d["epsilon"]),
            delta=float(d["delta"]),
            sigma=float(d["sigma"]),
            sensitivity=float(d["sensitivity"]),
            mechanism=str(d["mechanism"]),
            task=str(d["task"]),
        )


def privatize_histogram(
    class_counts: np.ndarray,
    num_samples: int,
    task: str,
    config: StatsDPConfig,
    rng: np.random.Generator | None = None,
) -> HistogramRelease:
    """The Gaussian mechanism on (n_1..n_C, N_k), then post-processing to a consistent integer histogram.

    Multi-label: n'_i = n_i + Z_i and N' = N_k + Z_0 with Z ~ N(0, sigma^2), sigma for sensitivity
    sqrt(C + 1); then N' = max(round(N'), 1) and n'_i = clip(round(n'_i), 0, N').
    Multi-class: n'_i = max(round(n_i + Z_i), 0) with sigma for sensitivity sqrt(2), and
    N' = max(sum_i n'_i, 1) (the counts of a multi-class histogram sum to N).
    Rounding and clipping are post-processing. ``rng`` defaults to a generator seeded from the OS
    (never from the job's seed, which the server knows).
    """
    counts = np.asarray(class_counts, dtype=np.float64)
    if counts.ndim != 1 or counts.size == 0 or np.any(counts < 0) or num_samples < 0:
        raise ValueError(
            f"privatize_histogram: need a non-empty vector of non-negative counts and N >= 0, got "
            f"{counts.tolist()} and {num_samples}"
        )
    rng = rng if rng is not None else np.random.default_rng(secrets.randbits(128))
    sensitivity = histogram_sensitivity(counts.size, task)
    sigma = gaussian_sigma(config.epsilon, config.delta, sensitivity, config.mechanism)
    noisy_counts = counts + rng.normal(0.0, sigma, size=counts.size)
    if task == "multilabel":
        n = max(int(np.rint(num_samples + rng.normal(0.0, sigma))), 1)
        released = np.clip(np.rint(noisy_counts), 0, n).astype(np.int64)
    else:
        released = np.maximum(np.rint(noisy_counts), 0).astype(np.int64)
        n = max(int(released.sum()), 1)
    return HistogramRelease(
        class_counts=released,
        num_samples=n,
        epsilon=config.epsilon,
        delta=config.delta,
        sigma=sigma,
        sensitivity=sensitivity,
        mechanism=config.mechanism,
        task=task,
    )


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(text)) or "_"


def _write_json_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def released_histogram(trainer: Any, rng: np.random.Generator | None = None) -> tuple[np.ndarray, int]:
    """What a site may reveal of its histogram: (class_counts, N_k), noised when statistics DP is on.

    ``trainer`` is a :class:`fedweigh.site.SiteTrainer` (``args``, ``class_counts``, ``site.train``,
    ``job_id``, ``site_name``). Without ``args.stats_dp_epsilon`` this is the exact histogram. With it,
    the release is drawn ONCE per job and site and kept on the trainer (``trainer.stats_release``) and,
    for an NVFlare job, in ``STATS_RELEASE_FILE`` in the working directory, so that a relaunched client
    or a repeated request sends the same release instead of spending the budget again.
    """
    config = StatsDPConfig.from_args(getattr(trainer, "args", None))
    counts = np.asarray(trainer.class_counts)
    num_samples = len(trainer.site.train)
    if config is None:
        return counts, num_samples
    release: HistogramRelease | None = getattr(trainer, "stats_release", None)
    job_id = str(getattr(trainer, "job_id", LOCAL_JOB_ID))
    path = None
    if job_id != LOCAL_JOB_ID:
        path = Path(STATS_RELEASE_FILE.format(job_id=_safe_name(job_id), site=_safe_name(trainer.site_name)))
    if release is None and path is not None and path.is_file():
        release = HistogramRelease.from_dict(json.loads(path.read_text()))
        logger.info("%s: reusing the label statistics released earlier in job %s", trainer.site_name, job_id)
    if release is not None and (
        release.epsilon != config.epsilon
        or release.delta != config.delta
        or release.class_counts.size != counts.size
    ):
        raise ValueError(
            f"{trainer.site_name}: the statistics released earlier in job {job_id} used (epsilon={release.epsilon}, "
            f"delta={release.delta}, {release.class_counts.size} classes), the job now asks for "
            f"(epsilon={config.epsilon}, delta={config.delta}, {counts.size} classes)"
        )
    if release is None:
        release = privatize_histogram(counts, num_samples, trainer.site.train.task, config, rng)
        if path is not None:
            _write_json_atomic(path, release.as_dict())
        logger.info(
            "%s: label statistics noised (Gaussian, sigma=%.3f, sensitivity=%.3f, epsilon=%g, delta=%g)",
            trainer.site_name,
            release.sigma,
            release.sensitivity,
            release.epsilon,
            release.delta,
        )
    trainer.stats_release = release
    return release.class_counts, release.num_samples


# ============================================================================ per-sample losses
class PerSampleLoss(nn.Module):
    """A loss split into per-sample terms l_i, as DP-SGD needs: loss = mean_i l_i (or sum, or the vector).

    l_i is ``loss_fn`` on sample i alone, so no sample's term depends on another sample of the batch.
    For the default losses (masked BCE, cross-entropy) and fedweigh's losses this equals the batch loss
    when no label is unknown; with unknown (NaN) labels the masked mean is taken per sample. The two
    default losses are computed vectorised, any other ``loss_fn`` sample by sample. ``reduction``
    (``"mean"``, ``"sum"``, ``"none"``) is read and set by Opacus' ghost clipping.
    """

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], task: str) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self.task = task
        self.reduction = "mean"
        # the default losses have a closed per-sample form; a weighted or smoothed cross-entropy does not
        self._vectorised = isinstance(loss_fn, MaskedBCEWithLogitsLoss) or (
            type(loss_fn) is nn.CrossEntropyLoss and loss_fn.weight is None and loss_fn.label_smoothing == 0.0
        )

    def per_sample(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The vector (B,) of per-sample losses."""
        if self._vectorised and self.task == "multilabel":
            known = ~torch.isnan(targets)
            terms = F.binary_cross_entropy_with_logits(
                logits, torch.where(known, targets, 0.0), reduction="none"
            )
            return (terms * known).sum(dim=1) / known.sum(dim=1).clamp_min(1)
        if self._vectorised:
            return F.cross_entropy(logits, targets.reshape(-1).long(), reduction="none")
        if logits.shape[0] == 0:
            return logits.sum(dim=1)
        return torch.stack(
            [self.loss_fn(logits[i : i + 1], targets[i : i + 1]) for i in range(logits.shape[0])]
        )

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses = self.per_sample(logits, targets)
        if self.reduction == "none":
            return losses
        if self.reduction == "sum":
            return losses.sum()
        return losses.sum() / max(int(losses.shape[0]), 1)


# ============================================================================ fast per-sample gradients
def _conv2d_grad_sample(
    layer: nn.Conv2d, a: torch.Tensor, g: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample grads of a Conv2d: dW_i = G_i U(a_i)^T with U the im2col unfold (B, C_in k k, T).

    The unfold is a strided view (Opacus' ``unfold2d``) for outputs of 64+ positions, ATen's im2col
    for smaller ones, and no unfold at all for 1x1 convolutions (whichever measured fastest on CPU).
    """
    n = a.shape[0]
    grads = g.reshape(n, g.shape[1], -1)
    if layer.kernel_size == (1, 1) and layer.stride == (1, 1) and layer.padding == (0, 0):
        cols = a.reshape(n, a.shape[1], -1)
    elif grads.shape[-1] >= 64:
        from opacus.utils.tensor_utils import unfold2d

        cols = unfold2d(
            a,
            kernel_size=layer.kernel_size,
            padding=layer.padding,
            stride=layer.stride,
            dilation=layer.dilation,
        )
    else:
        cols = F.unfold(
            a, layer.kernel_size, dilation=layer.dilation, padding=layer.padding, stride=layer.stride
        )
    out = {layer.weight: torch.bmm(grads, cols.transpose(1, 2)).view(n, *layer.weight.shape)}
    if layer.bias is not None:
        out[layer.bias] = grads.sum(dim=2)
    return out


def _linear_grad_sample(
    layer: nn.Linear, a: torch.Tensor, g: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample grads of a Linear layer: dW_i = sum_t g_it a_it^T, db_i = sum_t g_it."""
    out = {layer.weight: torch.einsum("n...o,n...i->noi", g, a)}
    if layer.bias is not None:
        out[layer.bias] = g.reshape(g.shape[0], -1, g.shape[-1]).sum(dim=1)
    return out


def _group_norm_grad_sample(
    layer: nn.GroupNorm, a: torch.Tensor, g: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample grads of GroupNorm: dgamma_i = sum_hw x_hat_i g_i, dbeta_i = sum_hw g_i."""
    x_hat = F.group_norm(a, layer.num_groups, eps=layer.eps)
    return {layer.weight: (x_hat * g).flatten(2).sum(dim=2), layer.bias: g.flatten(2).sum(dim=2)}


def _instance_norm_grad_sample(
    layer: nn.InstanceNorm2d, a: torch.Tensor, g: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample grads of an affine InstanceNorm2d (no running statistics)."""
    x_hat = F.instance_norm(a, eps=layer.eps)
    return {layer.weight: (x_hat * g).flatten(2).sum(dim=2), layer.bias: g.flatten(2).sum(dim=2)}


_FAST_SAMPLERS: dict[type, Callable[[Any, torch.Tensor, torch.Tensor], dict[nn.Parameter, torch.Tensor]]] = {
    nn.Conv2d: _conv2d_grad_sample,
    nn.Linear: _linear_grad_sample,
    nn.GroupNorm: _group_norm_grad_sample,
    nn.InstanceNorm2d: _instance_norm_grad_sample,
}


def _fast_unsupported(module: nn.Module) -> str | None:
    """Why :class:`FastGradSampler` cannot handle ``module`` (a module with trainable parameters), or None."""
    kind = type(module)
    if kind not in _FAST_SAMPLERS:
        return f"{kind.__name__} is not among {[k.__name__ for k in _FAST_SAMPLERS]}"
    if isinstance(module, nn.Conv2d) and (
        module.groups != 1 or isinstance(module.padding, str) or module.padding_mode != "zeros"
    ):
        return "Conv2d with groups, string padding or non-zero padding mode"
    if isinstance(module, (nn.GroupNorm, nn.InstanceNorm2d)):
        trainable = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if len(trainable) != 2 or getattr(module, "track_running_stats", False):
            return f"{kind.__name__} without both affine parameters trainable, or with running statistics"
    return None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the incoming gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _dp_optimizer_class():
    """Opacus' ``DPOptimizer`` with its per-step bookkeeping done once per step rather than per parameter.

    Same clipping, noise and scaling as ``DPOptimizer`` (flat clipping: factor_i = min(1, C / (||g_i|| + 1e-6)),
    summed_grad = sum_i factor_i g_i); Opacus' version re-lists the parameters and their per-sample
    gradients inside its per-parameter loops (quadratic in the number of parameter tensors).
    """
    from opacus.optimizers import DPOptimizer
    from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

    class FastDPOptimizer(DPOptimizer):
        def clip_and_accumulate(self) -> None:
            params = self.params
            grad_samples = [self._get_flat_grad_sample(p) for p in params]
            if len(grad_samples[0]) == 0:
                factor = torch.zeros((0,), device=grad_samples[0].device)
            else:
                norms = torch.stack([gs.reshape(len(gs), -1).norm(2, dim=-1) for gs in grad_samples], dim=1)
                factor = (self.max_grad_norm / (norms.norm(2, dim=1) + 1e-6)).clamp(max=1.0)
            for p, gs in zip(params, grad_samples, strict=True):
                _check_processed_flag(p.grad_sample)
                gs = gs.to(p.dtype)
                grad = torch.tensordot(factor.to(device=gs.device, dtype=p.dtype), gs, dims=1)
                p.summed_grad = grad if p.summed_grad is None else p.summed_grad + grad
                _mark_as_processed(p.grad_sample)

        def scale_grad(self) -> None:
            if self.loss_reduction == "mean":
                denominator = self.expected_batch_size * self.accumulated_iterations
                for p in self.params:
                    p.grad /= denominator

    return FastDPOptimizer


class FastGradSampler:
    """Per-sample gradients for Opacus' ``DPOptimizer`` from forward hooks and output-gradient hooks.

    Each supported layer (Conv2d, Linear, GroupNorm, affine InstanceNorm2d) keeps its input in a
    forward hook and gets d loss / d output from a hook on its output tensor; the per-sample gradient
    is a per-sample product of the two, written to ``p.grad_sample`` (what Opacus' hooks would write).
    Unlike Opacus' hooks it does not let autograd also compute the batch gradient of the weights, which
    DP-SGD throws away: during a training forward pass the parameters are detached from the graph
    (``requires_grad`` off, restored when the forward ends) and the input is made to require a
    gradient instead. ``loss_reduction="mean"`` scales by the batch size, as Opacus does.
    """

    def __init__(self, model: nn.Module, loss_reduction: str = "mean") -> None:
        problems = self.unsupported(model)
        if problems:
            raise ValueError(
                f"FastGradSampler: unsupported layers: {problems}; use an Opacus mode (e.g. 'hooks')"
            )
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(
                f"FastGradSampler: loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}"
            )
        self.model = model
        self.loss_reduction = loss_reduction
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._active = False
        self._forward: dict[str, bool] = {"scaled_at_output": False}
        self._handles = [
            model.register_forward_pre_hook(self._start),
            model.register_forward_hook(self._stop),
        ]
        for module in model.modules():
            if any(p.requires_grad for p in module.parameters(recurse=False)):
                self._handles.append(module.register_forward_hook(self._capture))

    @staticmethod
    def unsupported(model: nn.Module) -> dict[str, str]:
        """``{module name: reason}`` for every layer with trainable parameters the sampler cannot handle."""
        out = {}
        for name, module in model.named_modules():
            if any(p.requires_grad for p in module.parameters(recurse=False)):
                reason = _fast_unsupported(module)
                if reason:
                    out[name or type(module).__name__] = reason
        return out

    def _start(self, module: nn.Module, args: tuple) -> tuple | None:
        if not (module.training and torch.is_grad_enabled()):
            return None
        self._active = True
        self._forward = {"scaled_at_output": False}
        for p in self.params:
            p.grad_sample = None
            p.requires_grad_(False)
        return (args[0].detach().requires_grad_(True), *args[1:])

    def _stop(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not self._active:
            return None
        self._active = False
        for p in self.params:
            p.requires_grad_(True)
        n = args[0].shape[0]
        if n == 0:  # an empty Poisson batch: zero per-sample gradients (Opacus does the same)
            for p in self.params:
                p.grad_sample = torch.zeros((1, *p.shape), dtype=p.dtype, device=p.device)
            return None
        if self.loss_reduction == "mean" and isinstance(output, torch.Tensor):
            # d(mean loss)/d(logits) times B, once at the output, instead of in every layer's hook
            self._forward["scaled_at_output"] = True
            return _ScaleGrad.apply(output, float(n))
        return None

    def _capture(self, layer: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not self._active or args[0].shape[0] == 0:
            return
        activations = args[0].detach()
        sampler = _FAST_SAMPLERS[type(layer)]
        forward = self._forward  # this forward pass's state (scaled at the output or not), read in backward

        def on_grad(grad: torch.Tensor) -> None:
            if self.loss_reduction == "mean" and not forward["scaled_at_output"]:
                grad = grad * grad.shape[0]
            for p, gs in sampler(layer, activations, grad).items():
                prev = getattr(p, "grad_sample", None)
                p.grad_sample = gs if prev is None else prev + gs

        output.register_hook(on_grad)

    def remove(self) -> None:
        """Remove the hooks and the per-sample gradients."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for p in self.params:
            p.requires_grad_(True)
            if hasattr(p, "grad_sample"):
                del p.grad_sample


def clipped_mean_gradient(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    mode: str,
    max_grad_norm: float,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    task: str = "multilabel",
) -> dict[str, torch.Tensor]:
    """The noise-free DP-SGD gradient of one fixed batch, (1/B) sum_i clip_C(g_i), as ``mode`` computes it.

    Works on a copy of ``model``; keys are the model's parameter names. For checking that the
    per-sample gradient implementations (``"fast"`` and Opacus' modes) agree, and for benchmarks.
    """
    import copy

    from torch.utils.data import DataLoader, TensorDataset

    if mode not in DP_MODES or mode == "auto":
        raise ValueError(f"clipped_mean_gradient: mode must be one of {DP_MODES[1:]}, got {mode!r}")
    model = copy.deepcopy(model).train()
    criterion: Any = PerSampleLoss(loss_fn if loss_fn is not None else default_loss(task), task)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    n = int(x.shape[0])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*([Ss]ecure RNG|[Ff]ull backward hook).*")
        if mode == "fast":
            sampler = FastGradSampler(model)
            train_model: nn.Module = model
            dp_optimizer = _dp_optimizer_class()(
                optimizer, noise_multiplier=0.0, max_grad_norm=max_grad_norm, expected_batch_size=n
            )
        else:
            from opacus import PrivacyEngine

            made = PrivacyEngine(accountant="rdp").make_private(
                module=model,
                optimizer=optimizer,
                data_loader=DataLoader(TensorDataset(x, y), batch_size=n),
                criterion=criterion,
                noise_multiplier=0.0,
                max_grad_norm=max_grad_norm,
                grad_sample_mode=mode,
                poisson_sampling=False,
            )
            train_model, dp_optimizer = made[0], made[1]
            if mode == "ghost":
                criterion = made[2]
        dp_optimizer.zero_grad(set_to_none=True)
        criterion(train_model(x), y).backward()
        dp_optimizer.pre_step()
    if mode == "fast":
        sampler.remove()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


# ============================================================================ DP-SGD across rounds
@dataclass
class DPRoundReport:
    """What one round of DP-SGD spent: ``epsilon`` is the accountant's total after the round."""

    epsilon: float
    delta: float
    noise_multiplier: float
    sample_rate: float
    steps: int
    total_steps: int
    mode: str
    history: list[tuple[float, float, int]] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """The figures a site reports with its round result."""
        return {"dp_epsilon": self.epsilon, "dp_noise_multiplier": self.noise_multiplier}


def make_accountant(name: str):
    """A fresh Opacus accountant (``"rdp"`` or ``"prv"``)."""
    from opacus.accountants import create_accountant

    if name not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {name!r}")
    return create_accountant(mechanism=name)


def epsilon_for(history: list[tuple[float, float, int]], delta: float, accountant: str = "rdp") -> float:
    """Epsilon of a history of (noise multiplier, sample rate, steps) under ``accountant``."""
    acc = make_accountant(accountant)
    acc.history = [(float(s), float(q), int(n)) for s, q, n in history]
    if not acc.history:
        return 0.0
    with warnings.catch_warnings():  # "optimal order is the largest alpha": the default orders are kept
        warnings.filterwarnings("ignore", message=".*largest alpha.*")
        return float(acc.get_epsilon(delta=delta))


def _extend_history(
    history: list[tuple[float, float, int]], sigma: float, sample_rate: float, steps: int
) -> list[tuple[float, float, int]]:
    """``history`` after ``steps`` more steps at (sigma, q), merged as Opacus' accountants merge them."""
    if steps <= 0:
        return list(history)
    if history and history[-1][0] == sigma and history[-1][1] == sample_rate:
        return [*history[:-1], (sigma, sample_rate, history[-1][2] + steps)]
    return [*history, (sigma, sample_rate, steps)]


def dp_state_path(job_id: str, site_name: str, folder: str | Path = ".") -> Path:
    """Where a site keeps its DP-SGD accountant for a job."""
    return Path(folder) / DP_STATE_FILE.format(job_id=_safe_name(job_id), site=_safe_name(site_name))


_ONEDNN_HINT_GIVEN = False


def _hint_onednn_cache(device: str | torch.device) -> None:
    """Log once that DP-SGD on CPU wants a larger oneDNN primitive cache (Poisson batches vary in size)."""
    global _ONEDNN_HINT_GIVEN
    if (
        _ONEDNN_HINT_GIVEN
        or torch.device(device).type != "cpu"
        or os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    ):
        return
    _ONEDNN_HINT_GIVEN = True
    logger.info(
        "DP-SGD on CPU: Poisson batches vary in size and overflow oneDNN's primitive cache (1,024); set "
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY=8192 in the environment before the first convolution "
        "(about 2x faster DP epochs of the compact DenseNet)"
    )


def _check_dp_compatible(model: nn.Module, site: str) -> None:
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        raise ValueError(
            f"{site}: DP-SGD cannot train this model ({len(errors)} problem(s), e.g. {errors[0]}); build it with "
            "norm='group' or 'instance' (ClientArgs switches 'batch' to 'group' when DP-SGD is on) or pass it "
            "through fedweigh.models.make_opacus_compatible"
        )


class DPSGD:
    """DP-SGD for one site across the rounds of a job, with a persistent privacy accountant.

    Args:
        config: the job's DP-SGD settings.
        state_path: JSON file that keeps the accountant history between rounds and client processes
            (None: memory only, e.g. in-process runs). An existing file is loaded.
        site_name: names the site in messages.
        seed: seeds Poisson sampling and noise, for reproducible tests only. The default (None) draws
            fresh seeds from the OS each round: the job's seed is known to the server, and noise it
            could regenerate would protect nothing.
    """

    def __init__(
        self,
        config: DPConfig,
        state_path: str | Path | None = None,
        site_name: str = "site",
        seed: int | None = None,
    ) -> None:
        self.config = config
        self.state_path = Path(state_path) if state_path is not None else None
        self.site_name = site_name
        self.seed = seed
        self.accountant = make_accountant(config.accountant)
        self.noise_multiplier: float | None = config.noise_multiplier
        self.sample_rate: float | None = None
        self.rounds: list[dict] = []
        self._epsilon_cache: dict[tuple, float] = {}
        if self.state_path is not None and self.state_path.is_file():
            self._load()

    # ---------------------------------------------------------------- persistence
    def _load(self) -> None:
        assert self.state_path is not None
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(
                f"{self.site_name}: cannot read the DP-SGD accountant {self.state_path}: {e}"
            ) from e
        if state.get("format") != _STATE_FORMAT or state.get("accountant") != self.config.accountant:
            raise ValueError(
                f"{self.site_name}: {self.state_path} holds a '{state.get('accountant')}' accountant (format "
                f"{state.get('format')}), the job uses '{self.config.accountant}'"
            )
        if float(state["delta"]) != self.config.delta or state.get("target_epsilon") != self.config.epsilon:
            raise ValueError(
                f"{self.site_name}: {self.state_path} was written for (epsilon={state.get('target_epsilon')}, "
                f"delta={state['delta']}), the job asks for (epsilon={self.config.epsilon}, delta={self.config.delta})"
            )
        self.accountant.history = [(float(s), float(q), int(n)) for s, q, n in state["history"]]
        self.noise_multiplier = state.get("noise_multiplier")
        self.sample_rate = state.get("sample_rate")
        self.rounds = list(state.get("rounds", []))
        logger.info(
            "%s: DP-SGD accountant reloaded from %s (%d steps, epsilon %.4f)",
            self.site_name,
            self.state_path,
            self.total_steps,
            self.epsilon(),
        )

    def _save(self) -> None:
        if self.state_path is None:
            return
        _write_json_atomic(
            self.state_path,
            {
                "format": _STATE_FORMAT,
                "site": self.site_name,
                "accountant": self.config.accountant,
                "target_epsilon": self.config.epsilon,
                "delta": self.config.delta,
                "max_grad_norm": self.config.max_grad_norm,
                "noise_multiplier": self.noise_multiplier,
                "sample_rate": self.sample_rate,
                "history": [list(h) for h in self.accountant.history],
                "rounds": self.rounds,
            },
        )

    # ---------------------------------------------------------------- accounting
    @property
    def total_steps(self) -> int:
        """Optimizer steps accounted so far (all rounds, all processes of this job)."""
        return int(sum(n for _, _, n in self.accountant.history))

    def epsilon(self) -> float:
        """The accountant's epsilon for the steps taken, at the configured delta (cached per history)."""
        return self._epsilon_of(self.accountant.history)

    def _epsilon_of(self, history: list[tuple[float, float, int]]) -> float:
        key = tuple(tuple(h) for h in history)
        if key not in self._epsilon_cache:
            self._epsilon_cache[key] = epsilon_for(history, self.config.delta, self.config.accountant)
        return self._epsilon_cache[key]

    def _noise_multiplier(self, sample_rate: float, steps_per_round: int, total_rounds: int | None) -> float:
        if self.noise_multiplier is not None:
            if (
                self.config.epsilon is not None
                and self.sample_rate is not None
                and self.sample_rate != sample_rate
            ):
                raise ValueError(
                    f"{self.site_name}: the DP-SGD noise was planned for sample rate {self.sample_rate}, this "
                    f"round's data gives {sample_rate} (did the site's training set or batch size change?)"
                )
            return float(self.noise_multiplier)
        from opacus.accountants.utils import get_noise_multiplier

        if not total_rounds or total_rounds < 1:
            raise ValueError(
                f"{self.site_name}: DP-SGD with a target epsilon needs the job's planned number of rounds "
                "(total_rounds) to spread the budget; pass it to SiteTrainer.run_round, or give a noise multiplier"
            )
        total_steps = int(total_rounds) * steps_per_round
        assert self.config.epsilon is not None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sigma = get_noise_multiplier(
                target_epsilon=self.config.epsilon,
                target_delta=self.config.delta,
                sample_rate=sample_rate,
                steps=total_steps,
                accountant=self.config.accountant,
            )
        logger.info(
            "%s: DP-SGD noise multiplier %.4f for epsilon %g, delta %g over %d rounds x %d steps (q = %.4g)",
            self.site_name,
            sigma,
            self.config.epsilon,
            self.config.delta,
            total_rounds,
            steps_per_round,
            sample_rate,
        )
        return float(sigma)

    def _resolve_mode(self, model: nn.Module) -> str:
        if self.config.mode != "auto":
            return self.config.mode
        problems = FastGradSampler.unsupported(model)
        if problems:
            logger.info(
                "%s: DP-SGD uses Opacus' hooks (fast mode cannot handle %s)", self.site_name, problems
            )
            return "hooks"
        return "fast"

    def _generator(self, stream: int) -> torch.Generator:
        if self.seed is None:
            return torch.Generator().manual_seed(secrets.randbits(63))
        return torch.Generator().manual_seed(self.seed * 1_000_003 + 2 * len(self.rounds) + stream)

    # ---------------------------------------------------------------- training
    def train_round(
        self,
        model: nn.Module,
        data: LabeledImages,
        cfg: TrainConfig,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        global_params: Mapping[str, np.ndarray | torch.Tensor] | None = None,
        total_rounds: int | None = None,
    ) -> tuple[TrainResult, DPRoundReport]:
        """One round of local DP-SGD on ``model`` (in place); returns the training result and what it spent.

        Uses ``cfg``'s epochs, batch size (the expected Poisson batch), optimizer and ``max_steps``.
        With ``cfg.fedprox_mu > 0`` and ``global_params``, FedProx's gradient mu (theta - theta_g) is added
        to the noised gradient: it does not depend on the data, so it costs no privacy (a proximal term in
        the loss would be clipped with each sample's gradient instead). Raises
        :class:`PrivacyBudgetExhausted` before training if the round would take epsilon above the target.
        """
        from opacus.data_loader import DPDataLoader

        _check_dp_compatible(model, self.site_name)
        model.to(cfg.device)
        if len(data) == 0 or cfg.epochs == 0:
            return TrainResult(0, 0, float("nan")), self._report(0, "none")
        mode = self._resolve_mode(model)
        _hint_onednn_cache(cfg.device)
        base_loader = make_loader(data, cfg.batch_size, shuffle=False, seed=0)
        loader = DPDataLoader.from_data_loader(base_loader, generator=self._generator(0))
        steps_per_epoch = len(loader)
        sample_rate = float(loader.sample_rate)
        planned = cfg.epochs * steps_per_epoch
        steps = planned if cfg.max_steps is None else min(planned, cfg.max_steps)
        sigma = self._noise_multiplier(sample_rate, steps, total_rounds)
        if self.config.epsilon is not None:
            after = self._epsilon_of(_extend_history(self.accountant.history, sigma, sample_rate, steps))
            if after > self.config.epsilon * (1 + 1e-9):
                raise PrivacyBudgetExhausted(
                    f"{self.site_name}: DP-SGD budget exhausted: {self.total_steps} steps spent epsilon "
                    f"{self.epsilon():.4f}; {steps} more would reach {after:.4f} > target {self.config.epsilon} "
                    f"(planned for {total_rounds} rounds)"
                )
        self.noise_multiplier, self.sample_rate = sigma, sample_rate

        criterion: Any = PerSampleLoss(loss_fn if loss_fn is not None else default_loss(data.task), data.task)
        optimizer = make_optimizer(model, cfg)
        noise_gen = self._generator(1)
        expected_batch_size = max(1, int(len(data) * sample_rate))
        sampler: FastGradSampler | None = None
        wrapped: Any = None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Ss]ecure RNG.*")
            warnings.filterwarnings("ignore", message=".*full_backward_hook.*")
            if mode == "fast":
                sampler = FastGradSampler(model)
                train_model: nn.Module = model
                dp_optimizer = _dp_optimizer_class()(
                    optimizer,
                    noise_multiplier=sigma,
                    max_grad_norm=self.config.max_grad_norm,
                    expected_batch_size=expected_batch_size,
                    loss_reduction="mean",
                    generator=noise_gen,
                )
                dp_optimizer.attach_step_hook(self.accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
            else:
                from opacus import PrivacyEngine

                engine = PrivacyEngine(accountant=self.config.accountant)
                engine.accountant = self.accountant
                made = engine.make_private(
                    module=model,
                    optimizer=optimizer,
                    data_loader=base_loader,
                    criterion=criterion,
                    noise_multiplier=sigma,
                    max_grad_norm=self.config.max_grad_norm,
                    grad_sample_mode=mode,
                    noise_generator=noise_gen,
                )
                if mode == "ghost":
                    wrapped, dp_optimizer, criterion, _ = made
                else:
                    wrapped, dp_optimizer, _ = made
                train_model = wrapped
                # account with the Poisson rate of the loader used below (Opacus' own loader is not used)
                dp_optimizer.step_hook = None
                dp_optimizer.attach_step_hook(self.accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
        if cfg.fedprox_mu > 0 and global_params is not None:
            self._add_prox_after_noise(dp_optimizer, model, global_params, cfg.fedprox_mu)
        before = self.total_steps
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*[Ff]ull backward hook.*")
                result = run_epochs(
                    train_model,
                    loader,
                    dp_optimizer,
                    criterion,
                    cfg.epochs,
                    cfg.max_steps,
                    None,
                    device=cfg.device,
                )
        finally:
            if sampler is not None:
                sampler.remove()
            if wrapped is not None:
                wrapped._close()
            for p in model.parameters():
                for attr in ("summed_grad", "grad_sample", "_processed"):
                    if hasattr(p, attr):
                        delattr(p, attr)
                p.grad = None
        taken = self.total_steps - before
        if taken != result.num_steps:
            raise RuntimeError(
                f"{self.site_name}: the accountant recorded {taken} steps, training took {result.num_steps}"
            )
        report = self._report(result.num_steps, mode)
        self.rounds.append({"steps": result.num_steps, "epsilon": report.epsilon, "mode": mode})
        self._save()
        return result, report

    @staticmethod
    def _add_prox_after_noise(
        optimizer: Any, model: nn.Module, global_params: Mapping[str, np.ndarray | torch.Tensor], mu: float
    ) -> None:
        """Chain FedProx's gradient mu (theta - theta_g) after the accountant's step hook (post-noise)."""
        anchors = []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if name not in global_params:
                raise KeyError(f"FedProx under DP-SGD: global parameters lack {name!r}")
            anchors.append(
                (p, torch.as_tensor(global_params[name]).detach().to(device=p.device, dtype=p.dtype))
            )
        accountant_hook = optimizer.step_hook

        def hook(opt: Any) -> None:
            if accountant_hook is not None:
                accountant_hook(opt)
            with torch.no_grad():
                for p, g in anchors:
                    if p.grad is not None:
                        p.grad.add_(p.detach() - g, alpha=mu)

        optimizer.step_hook = hook

    def _report(self, steps: int, mode: str) -> DPRoundReport:
        return DPRoundReport(
            epsilon=self.epsilon(),
            delta=self.config.delta,
            noise_multiplier=float(self.noise_multiplier or 0.0),
            sample_rate=float(self.sample_rate or 0.0),
            steps=steps,
            total_steps=self.total_steps,
            mode=mode,
            history=[tuple(h) for h in self.accountant.history],
        )


__all__ = [
    "ACCOUNTANTS",
    "DPConfig",
    "DPRoundReport",
    "DPSGD",
    "DP_MODES",
    "FastGradSampler",
    "HistogramRelease",
    "PerSampleLoss",
    "PrivacyBudgetExhausted",
    "StatsDPConfig",
    "analytic_gaussian_sigma",
    "classic_gaussian_sigma",
    "clipped_mean_gradient",
    "dp_state_path",
    "epsilon_for",
    "gaussian_delta",
    "gaussian_sigma",
    "histogram_sensitivity",
    "privatize_histogram",
    "released_histogram",
]
