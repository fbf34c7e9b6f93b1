"""The aggregate's check before it becomes the global model, and the buffers one site cannot poison.

A round's aggregate theta_g^t is a candidate until it passes :func:`model_problem`:

- every floating-point array is finite;
- every BatchNorm ``running_var`` is non-negative (a negative variance makes
  ``(x - mean) / sqrt(var + eps)`` NaN, so the sites could not evaluate the model);
- with a :class:`ModelProbe` (the server holds the architecture: the job's persistor, the
  benchmark's scorer), the model's outputs on a fixed probe batch are finite. The batch is synthetic,
  deterministic and the server's own (``size`` images of standard-normal pixels, seed 0, at the
  model's ``in_channels`` x ``img_size``): it holds no site's data, and any model the sites can
  evaluate must map it to finite numbers.

Buffers (BatchNorm's running statistics and batch counter) are data statistics, not parameters: the
round takes each one as the coordinate-wise median over the sites' values (:func:`robust_buffers`,
from three sites on), so one site's buffers cannot move them outside the range of the others'.
:class:`fedweigh.server.rounds.RoundStep` runs both; when the candidate fails, it finds the
contribution that caused it (leave-one-out) and leaves that site out.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from fedweigh.arrays import Params
from fedweigh.weighting.geometry import is_buffer_name

__all__ = ["PROBE_SIZE", "ModelProbe", "buffer_keys", "model_problem", "robust_buffers"]

#: Images in the server's probe batch.
PROBE_SIZE = 4
#: Robust buffers from this many sites on (with two, the median is their mean).
ROBUST_BUFFER_MIN_SITES = 3


class ModelProbe:
    """The outputs of a candidate global model on the server's fixed probe batch.

    Args:
        model: a torch module of the job's architecture (copied; the original is left alone). The
            batch's shape is (``size``, ``model.in_channels``, ``model.img_size``, ``model.img_size``)
            (FedweighNet's attributes), or ``input_shape`` (without the batch dimension).
        input_shape: the shape of one input, for models without those attributes.
        size: images in the batch; seed: its seed (standard-normal values).
    """

    def __init__(
        self,
        model: Any,
        input_shape: Sequence[int] | None = None,
        *,
        size: int = PROBE_SIZE,
        seed: int = 0,
    ):
        import torch

        inner = getattr(model, "_module", model)  # Opacus' wrapper
        self._model = copy.deepcopy(inner).to("cpu").eval()
        #: the state-dict keys of the model's buffers (the exact set)
        self.buffer_keys = frozenset(name for name, _ in self._model.named_buffers())
        if input_shape is None:
            channels, side = getattr(inner, "in_channels", None), getattr(inner, "img_size", None)
            if channels is None or side is None:
                raise ValueError(
                    f"ModelProbe: {type(inner).__name__} has no in_channels / img_size: give input_shape"
                )
            input_shape = (int(channels), int(side), int(side))
        generator = torch.Generator().manual_seed(seed)
        self.batch = torch.randn((size, *tuple(input_shape)), generator=generator)
        try:  # the probe must work on the model as given, or it cannot judge candidates
            self._outputs()
        except Exception as e:
            raise ValueError(f"ModelProbe: {type(inner).__name__} cannot run the probe batch: {e}") from None

    def _outputs(self) -> Any:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a few images: one thread is fastest, and never waits on busy cores
        try:
            with torch.no_grad():
                out = self._model(self.batch)
        finally:
            torch.set_num_threads(threads)
        if isinstance(out, (tuple, list)):
            out = out[0]
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"the model returns a {type(out).__name__}, not a tensor")
        return out

    def problem(self, params: Mapping[str, np.ndarray]) -> str | None:
        """Why the model with ``params`` cannot serve the sites (None: its probe outputs are finite)."""
        import torch

        from fedweigh.train import set_params

        try:
            set_params(self._model, params)
        except ValueError as e:
            return f"it does not load into the model ({e})"
        try:
            out = self._outputs()
        except Exception as e:  # the architecture ran the probe batch at construction: these params break it
            return f"the model fails on the server's probe batch ({type(e).__name__}: {e})"
        finite = torch.isfinite(out)
        if not bool(finite.all()):
            bad = int((~finite).sum())
            return f"{bad} of {out.numel()} of its outputs on the server's probe batch are not finite"
        return None


def buffer_keys(params: Mapping[str, Any], probe: ModelProbe | None = None) -> list[str]:
    """The buffers among ``params``: the probe model's exact set, else by name
    (:func:`fedweigh.weighting.geometry.is_buffer_name`)."""
    if probe is not None:
        return [k for k in params if k in probe.buffer_keys]
    return [k for k in params if is_buffer_name(k)]


def robust_buffers(
    aggregate: Params, contributions: Sequence[Mapping[str, Any]], keys: Collection[str]
) -> Params:
    """``aggregate`` with every buffer in ``keys`` replaced by the coordinate-wise median of the
    contributions' values (integer buffers rounded); from :data:`ROBUST_BUFFER_MIN_SITES` contributions
    on, else ``aggregate`` unchanged. One site of three or more cannot move a median outside the
    range of the others' values."""
    if len(contributions) < ROBUST_BUFFER_MIN_SITES or not keys:
        return aggregate
    out = dict(aggregate)
    for key in keys:
        ref = np.asarray(aggregate[key])
        stack = np.stack([np.asarray(c[key], dtype=np.float64) for c in contributions])
        median = np.median(stack, axis=0)
        if not np.issubdtype(ref.dtype, np.floating):
            median = np.rint(median)
        out[key] = median.astype(ref.dtype).reshape(ref.shape)
    return out


def model_problem(params: Mapping[str, Any], probe: ModelProbe | None = None) -> str | None:
    """Why ``params`` cannot become the global model (module docstring), or None."""
    for key, value in params.items():
        arr = np.asarray(value)
        if not np.issubdtype(arr.dtype, np.floating):
            continue
        if not np.isfinite(arr).all():
            return f"its array {key!r} holds non-finite values"
        if key.rsplit(".", 1)[-1] == "running_var" and (arr < 0).any():
            return f"its BatchNorm variance {key!r} has {int((arr < 0).sum())} negative value(s)"
    return probe.problem(params) if probe is not None else None
