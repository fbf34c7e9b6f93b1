"""Server-side checks of a client result before it can influence the global model."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fedweigh.flare.constants import META_NUM_SAMPLES, META_SCALARS


class InvalidClientResult(ValueError):
    """A client result the server must skip; the message names the site and the problem."""


@dataclass
class ResultLimits:
    """Plausibility bounds for client results."""

    max_num_samples: int = 10_000_000
    max_num_steps: int = 10_000_000
    max_abs_scalar: float = 1e12


def _as_array(value) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def check_count(site: str, field: str, value, upper: int) -> int:
    """A non-negative integer count within ``upper``."""
    if isinstance(value, bool) or value is None:
        raise InvalidClientResult(f"{site}: {field} must be an integer, got {value!r}")
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        raise InvalidClientResult(f"{site}: {field} must be an integer, got {value!r}") from None
    if not math.isfinite(as_float) or as_float != int(as_float):
        raise InvalidClientResult(f"{site}: {field} must be an integer, got {value!r}")
    count = int(as_float)
    if count <= 0:
        raise InvalidClientResult(f"{site}: {field} must be positive, got {count}")
    if count > upper:
        raise InvalidClientResult(f"{site}: {field}={count} exceeds the plausibility bound {upper}")
    return count


def check_params(
    site: str, params: Mapping | None, reference: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Same keys and shapes as the global model, all values finite."""
    if not params:
        raise InvalidClientResult(f"{site}: result holds no parameters")
    missing = sorted(set(reference) - set(params))
    unexpected = sorted(set(params) - set(reference))
    if missing or unexpected:
        raise InvalidClientResult(
            f"{site}: parameter keys differ from the global model (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    out: dict[str, np.ndarray] = {}
    for key, ref in reference.items():
        arr = _as_array(params[key])
        if arr.shape != np.shape(ref):
            raise InvalidClientResult(
                f"{site}: parameter {key!r} has shape {arr.shape}, expected {np.shape(ref)}"
            )
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise InvalidClientResult(f"{site}: parameter {key!r} holds non-finite values")
        out[key] = arr
    return out


def check_scalars(site: str, scalars, required: tuple[str, ...], limits: ResultLimits) -> dict[str, float]:
    """The scalars a scheme needs, present, finite and within range."""
    if scalars is None:
        scalars = {}
    if not isinstance(scalars, Mapping):
        raise InvalidClientResult(
            f"{site}: meta[{META_SCALARS!r}] must be a mapping, got {type(scalars).__name__}"
        )
    out: dict[str, float] = {}
    for name, value in scalars.items():
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise InvalidClientResult(f"{site}: scalar {name!r} is not a number: {value!r}") from None
        if not math.isfinite(v) or abs(v) > limits.max_abs_scalar:
            raise InvalidClientResult(f"{site}: scalar {name!r}={value!r} is not finite or out of range")
        out[str(name)] = v
    missing = [name for name in required if name not in out]
    if missing:
        raise InvalidClientResult(f"{site}: missing scalar(s) {missing} that the weighting scheme needs")
    return out


def check_train_result(
    site: str,
    params: Mapping | None,
    meta: Mapping | None,
    reference: Mapping[str, np.ndarray],
    required_scalars: tuple[str, ...],
    limits: ResultLimits,
) -> tuple[dict[str, np.ndarray], int, int, dict[str, float]]:
    """Validated (params, num_samples, num_steps, scalars) of one training result."""
    meta = meta or {}
    if not isinstance(meta, Mapping):
        raise InvalidClientResult(f"{site}: meta must be a mapping")
    if META_NUM_SAMPLES not in meta:
        raise InvalidClientResult(f"{site}: meta lacks {META_NUM_SAMPLES!r}")
    num_samples = check_count(site, META_NUM_SAMPLES, meta[META_NUM_SAMPLES], limits.max_num_samples)
    num_steps = check_count(
        site, "NUM_STEPS_CURRENT_ROUND", meta.get("NUM_STEPS_CURRENT_ROUND", 1), limits.max_num_steps
    )
    scalars = check_scalars(site, meta.get(META_SCALARS), required_scalars, limits)
    checked = check_params(site, params, reference)
    return checked, num_samples, num_steps, scalars
