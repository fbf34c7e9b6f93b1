"""Annealing schedules (pure functions), used by FedDRAW's two coupled schedules.

Ramps map training progress x in [0, 1] to a value rising from 0 (x = 0) to 1 (x = 1):

    linear(x)            = x
    cosine(x)            = (1 - cos(pi x)) / 2                       (slow - fast - slow)
    exponential(x, k)    = (1 - exp(-k x)) / (1 - exp(-k)),  k > 0    (fast start, saturating)

Progress of round t in 1..T is x = (t - 1) / (T - 1) (x = 0 when T = 1), so the first round sits at
the start of a ramp and the last at its end.

The deferred anneal holds beta_max until the deferral point t_d = rho T and then anneals to 0 at T:

    beta_t = beta_max                                       for t <= t_d
    beta_t = beta_max (1 - ramp((t - t_d) / (T - t_d)))    for t > t_d
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

RampShape = Literal["linear", "cosine", "exponential"]
RAMP_SHAPES: tuple[str, ...] = ("linear", "cosine", "exponential")


def _check_x(x: float) -> float:
    x = float(x)
    if not math.isfinite(x) or x < 0.0 or x > 1.0:
        raise ValueError(f"progress must lie in [0, 1], got {x!r}")
    return x


def linear(x: float) -> float:
    """x."""
    return _check_x(x)


def cosine(x: float) -> float:
    """(1 - cos(pi x)) / 2."""
    return 0.5 * (1.0 - math.cos(math.pi * _check_x(x)))


def exponential(x: float, rate: float = 5.0) -> float:
    """(1 - exp(-rate x)) / (1 - exp(-rate)), rate > 0; rises fast, then saturates at 1."""
    x = _check_x(x)
    if not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"exponential rate must be a positive number, got {rate!r}")
    return -math.expm1(-rate * x) / -math.expm1(-rate)


def ramp(shape: str, x: float, rate: float = 5.0) -> float:
    """Dispatch to :func:`linear`, :func:`cosine` or :func:`exponential` by name."""
    fns: dict[str, Callable[[float], float]] = {
        "linear": linear,
        "cosine": cosine,
        "exponential": lambda v: exponential(v, rate),
    }
    if shape not in fns:
        raise ValueError(f"unknown schedule shape {shape!r}; known: {', '.join(RAMP_SHAPES)}")
    return fns[shape](x)


def _check_round(round_index: int, num_rounds: int) -> None:
    if int(num_rounds) != num_rounds or num_rounds < 1:
        raise ValueError(f"num_rounds must be an integer >= 1, got {num_rounds!r}")
    if int(round_index) != round_index or not 1 <= round_index <= num_rounds:
        raise ValueError(f"round_index must be an integer in 1..{num_rounds} (1-based), got {round_index!r}")


def progress(round_index: int, num_rounds: int) -> float:
    """x = (t - 1) / (T - 1) for round t of T (1-based); 0 when T = 1."""
    _check_round(round_index, num_rounds)
    if num_rounds == 1:
        return 0.0
    return (round_index - 1) / (num_rounds - 1)


def deferred_anneal(
    round_index: int,
    num_rounds: int,
    beta_max: float,
    rho: float,
    shape: str = "cosine",
    rate: float = 5.0,
) -> float:
    """beta_t: beta_max until t_d = rho * T, then annealed to 0 at t = T along ``shape``.

    rho in [0, 1]: rho = 0 starts annealing at once (beta_1 = beta_max (1 - ramp(1/T))), rho = 1
    never anneals (beta_t = beta_max throughout); any rho < 1 gives beta_T = 0 in the last round.
    """
    _check_round(round_index, num_rounds)
    if not math.isfinite(beta_max) or beta_max < 0:
        raise ValueError(f"beta_max must be a finite number >= 0, got {beta_max!r}")
    if not math.isfinite(rho) or not 0.0 <= rho <= 1.0:
        raise ValueError(f"rho must lie in [0, 1], got {rho!r}")
    if shape not in RAMP_SHAPES:
        raise ValueError(f"unknown schedule shape {shape!r}; known: {', '.join(RAMP_SHAPES)}")
    t_d = rho * num_rounds
    if round_index <= t_d:
        return float(beta_max)
    x = (round_index - t_d) / (num_rounds - t_d)
    return float(beta_max) * (1.0 - ramp(shape, min(x, 1.0), rate))
