"""Server-side checks of a client result before it can influence the global model.

Every check takes plain values (counts, scalars, arrays), so the NVFlare controller, the stock-FedAvg
aggregator, the encrypted path and the benchmark judge a result by the same rules. A failed check
raises :class:`InvalidClientResult` naming the site and the problem; the round step leaves that site
out of the round with the message as its reason.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

from fedweigh.arrays import check_same_layout
from fedweigh.errors import InvalidClientResult
from fedweigh.protocol import META_NUM_SAMPLES, META_NUM_STEPS, META_REFUSED, META_SCALARS

__all__ = [
    "RESERVED_RECORD_NAMES",
    "RESERVED_RECORD_PREFIXES",
    "DEFAULT_MAX_COUNT_RATIO",
    "CheckedMeta",
    "InvalidClientResult",
    "ResultLimits",
    "check_count",
    "check_meta",
    "check_params",
    "check_scalars",
    "check_site_metrics",
    "finite_metrics",
]

#: The fields the server writes on a round's record (``fedweigh_metrics.json`` rows, the CSV's
#: columns): a site's metric may not take one of these names, nor any name starting with one of
#: :data:`RESERVED_RECORD_PREFIXES` (the CSV's weight columns, the server's own measurements, the
#: TensorBoard groups). The scheme's schedule values (FedDRAW's ``lambda``, ...) are reserved too,
#: by the round step, which knows them.
RESERVED_RECORD_NAMES = frozenset(
    {
        "round",
        "rounds",
        "scheme",
        "weights",
        "excluded",
        "excluded_sites",
        "bounded",
        "global_updated",
        "round_seconds",
        "reason",
    }
)
RESERVED_RECORD_PREFIXES = ("weight/", "weights/", "server_", "scheme/", "global/", "site/")
#: A metric name: a letter, then letters, digits, ``_``, ``.``, ``-`` or ``/``; at most 64 characters.
_METRIC_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.\-/]{0,63}")


#: Default ``ResultLimits.max_count_ratio``: a site's sample count may be at most this many times
#: the median of the other sites' in the round, and its step count within this factor of theirs
#: either way (docs/security.md).
DEFAULT_MAX_COUNT_RATIO = 100.0
#: Default ``ResultLimits.min_step_ratio``: a step count below what the site's size makes plausible next
#: to the other sites' is raised to it (FedNova weighs by 1 / tau_k: fewer reported steps would buy
#: weight; :func:`fedweigh.server.safeguards.step_floor`, docs/security.md).
DEFAULT_MIN_STEP_RATIO = 1.25


@dataclass(frozen=True)
class ResultLimits:
    """Plausibility bounds for client results.

    max_num_samples, max_num_steps: absolute bounds on N_k and tau_k (a result above is left out).
    max_abs_scalar: bound on |scalar|.
    max_count_ratio: N_k above ``max_count_ratio`` x the median N_j of the other sites of the round
        is clipped to that bound, and so is tau_k outside [median / ratio, median x ratio] of the
        others' step counts (:func:`fedweigh.server.safeguards.plausible_counts`; None: off).
    min_step_ratio: tau_k below the step count its size makes plausible next to the other sites'
        (:func:`fedweigh.server.safeguards.step_floor`), divided by ``min_step_ratio``, is raised to
        it (fewer steps buy FedNova weight; default 1.25: at most a quarter more weight than an honest
        site of its size; None: only ``max_count_ratio``).
    """

    max_num_samples: int = 10_000_000
    max_num_steps: int = 10_000_000
    max_abs_scalar: float = 1e12
    max_count_ratio: float | None = DEFAULT_MAX_COUNT_RATIO
    min_step_ratio: float | None = DEFAULT_MIN_STEP_RATIO


@dataclass
class CheckedMeta:
    """The validated counts and scalars of one training result."""

    num_samples: int
    num_steps: int
    scalars: dict[str, float]


def check_count(site: str, field: str, value: object, upper: int) -> int:
    """A positive integer count within ``upper``."""
    if isinstance(value, bool) or value is None:
        raise InvalidClientResult(f"{site}: {field} must be an integer, got {value!r}")
    try:
        as_float = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
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
    """Same keys and shapes as the global model, real-valued, all values finite."""
    if not params:
        raise InvalidClientResult(f"{site}: result holds no parameters")
    try:
        return check_same_layout(site, params, reference)
    except ValueError as e:
        raise InvalidClientResult(str(e)) from None


def check_scalars(
    site: str,
    scalars: object,
    required: tuple[str, ...],
    limits: ResultLimits,
    ranges: Mapping[str, tuple[float, float]] | None = None,
) -> dict[str, float]:
    """The scalars the scheme asked for: present, finite, within ``limits`` and within ``ranges``
    (name -> (lowest, highest), inclusive; the scheme's :meth:`~fedweigh.weighting.base.WeightingScheme.scalar_range`).

    Scalars nobody asked for are dropped unread: the scheme never sees them (a site cannot, for
    instance, replace a similarity the server computes itself).
    """
    if scalars is None:
        scalars = {}
    if not isinstance(scalars, Mapping):
        raise InvalidClientResult(
            f"{site}: meta[{META_SCALARS!r}] must be a mapping, got {type(scalars).__name__}"
        )
    out: dict[str, float] = {}
    for name in required:
        if name not in scalars:
            continue
        value = scalars[name]
        if isinstance(value, bool):
            raise InvalidClientResult(f"{site}: scalar {name!r} is not a number: {value!r}")
        try:
            v = float(value)
        except (TypeError, ValueError, OverflowError):
            raise InvalidClientResult(f"{site}: scalar {name!r} is not a number: {value!r}") from None
        if not math.isfinite(v) or abs(v) > limits.max_abs_scalar:
            raise InvalidClientResult(f"{site}: scalar {name!r}={value!r} is not finite or out of range")
        low, high = (ranges or {}).get(name, (-math.inf, math.inf))
        if not low <= v <= high:
            raise InvalidClientResult(
                f"{site}: scalar {name!r}={v!r} lies outside its valid range [{low:g}, {high:g}]"
            )
        out[str(name)] = v
    missing = [name for name in required if name not in out]
    if missing:
        raise InvalidClientResult(f"{site}: missing scalar(s) {missing} that the weighting scheme needs")
    return out


def check_meta(
    site: str,
    meta: object,
    required_scalars: tuple[str, ...],
    limits: ResultLimits,
    ranges: Mapping[str, tuple[float, float]] | None = None,
) -> CheckedMeta:
    """Validated N_k, local steps and scalars of one training result's meta."""
    meta = meta or {}
    if not isinstance(meta, Mapping):
        raise InvalidClientResult(f"{site}: meta must be a mapping")
    if meta.get(META_REFUSED):
        raise InvalidClientResult(f"{site} refused under its site policy: {meta.get(META_REFUSED)}")
    if META_NUM_SAMPLES not in meta:
        raise InvalidClientResult(f"{site}: meta lacks {META_NUM_SAMPLES!r}")
    num_samples = check_count(site, META_NUM_SAMPLES, meta[META_NUM_SAMPLES], limits.max_num_samples)
    num_steps = check_count(site, META_NUM_STEPS, meta.get(META_NUM_STEPS, 1), limits.max_num_steps)
    scalars = check_scalars(site, meta.get(META_SCALARS), required_scalars, limits, ranges)
    return CheckedMeta(num_samples=num_samples, num_steps=num_steps, scalars=scalars)


def check_site_metrics(
    site: str, metrics: object, reserved: Collection[str] = ()
) -> tuple[dict[str, float], dict[str, str]]:
    """(accepted, refused) of a site's metrics: a metric is accepted when its name is a metric name
    (a letter, then letters, digits, ``_``, ``.``, ``-``, ``/``; at most 64 characters), is not a server
    field (:data:`RESERVED_RECORD_NAMES`, :data:`RESERVED_RECORD_PREFIXES`, ``reserved``) and its
    value is a finite real number; ``refused`` maps each refused name to the reason, naming the site.

    So a site's metrics never overwrite or break a field of the server's record, whatever it sends.
    """
    if metrics is None:
        return {}, {}
    if not isinstance(metrics, Mapping):
        return {}, {"<metrics>": f"{site}: its metrics are a {type(metrics).__name__}, not a mapping"}
    accepted: dict[str, float] = {}
    refused: dict[str, str] = {}
    for key, value in metrics.items():
        name = key if isinstance(key, str) else repr(key)
        if not isinstance(key, str) or not _METRIC_NAME.fullmatch(key):
            refused[name[:80]] = (
                f"{site}: metric name {name[:80]!r} is refused: a metric name is a letter, then "
                "letters, digits, '_', '.', '-' or '/' (at most 64 characters)"
            )
            continue
        if key in RESERVED_RECORD_NAMES or key in reserved or key.startswith(RESERVED_RECORD_PREFIXES):
            refused[key] = f"{site}: metric {key!r} is refused: the name is reserved for the server's record"
            continue
        number = _finite_number(value)
        if number is None:
            continue  # not a finite number: dropped, as ever (a site may send other things)
        accepted[key] = number
    return accepted, refused


def _finite_number(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def finite_metrics(metrics: object) -> dict[str, float]:
    """The entries of a site's metrics that are finite real numbers (anything else is dropped)."""
    if not isinstance(metrics, Mapping):
        return {}
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, bool):
            continue
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            continue
        if math.isfinite(number):
            out[str(key)] = number
    return out
