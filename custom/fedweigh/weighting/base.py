"""The contract between clients and weighting schemes.

A client's result is reduced to a :class:`ClientReport` (site name, N_k, local steps, the scalars
the client computed and, only in plaintext mode and only when a scheme needs them, its parameters).
A :class:`WeightingScheme` turns one round's reports into one weight per client. Weights act on
deltas (design.md, "The contract between clients and schemes"):

    theta_g^t = theta_g^{t-1} + sum_k w_k (theta_k^t - theta_g^{t-1})

which equals the weighted average of client models whenever sum_k w_k = 1.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from fedweigh.arrays import check_same_layout
from fedweigh.errors import HEIncompatibleScheme
from fedweigh.histograms import GlobalStats

Params = dict[str, np.ndarray]
IntegerBufferRule = Literal["weighted", "max"]

#: Scalar names a client may report (see each scheme's ``client_scalars``).
KNOWN_SCALARS: tuple[str, ...] = ("similarity", "skew", "imbalance", "discrepancy")

#: The range every scheme accepts for each known scalar (a scheme may narrow it, ``scalar_ranges``):
#: a cosine similarity lies in [-1, 1]; skews, imbalances and KL discrepancies are non-negative.
SCALAR_RANGES: dict[str, tuple[float, float]] = {
    "similarity": (-1.0, 1.0),
    "skew": (0.0, math.inf),
    "imbalance": (0.0, math.inf),
    "discrepancy": (0.0, math.inf),
}


@dataclass(frozen=True)
class ScalarContext:
    """What a site knows when it computes its scheme's scalars (as a loss is built from a
    :class:`fedweigh.losses.LossContext`).

    class_counts: the site's per-class label counts (positives per finding for multi-label data;
        under statistics DP, its noised release).
    num_samples: N_k, the site's training-set size.
    global_stats: the federation's label statistics from the statistics phase (None without it).
    params: the site's parameters after this round's local training.
    global_params: theta_g^{t-1}, the global model it trained from.
    previous_global: the global model it received in its previous training round (FedDRAW's
        ``similarity="direction"``; None in its first round).
    """

    class_counts: np.ndarray | None = None
    num_samples: int | None = None
    global_stats: GlobalStats | None = None
    params: Params | None = None
    global_params: Params | None = None
    previous_global: Params | None = None

    @property
    def global_class_counts(self) -> np.ndarray | None:
        """The federation's label histogram (None without the statistics phase)."""
        return None if self.global_stats is None else np.asarray(self.global_stats.class_counts)

    def counts(self, scheme: str) -> tuple[np.ndarray, int]:
        """(class_counts, num_samples); ValueError naming ``scheme`` when the site gave none."""
        if self.class_counts is None or self.num_samples is None:
            raise ValueError(
                f"{scheme}: the client needs its label counts and training-set size (class_counts, "
                "num_samples) for its scalars"
            )
        return np.asarray(self.class_counts), int(self.num_samples)

    def models(self, scheme: str) -> tuple[Params, Params]:
        """(params, global_params); ValueError naming ``scheme`` when the site gave none."""
        if self.params is None or self.global_params is None:
            raise ValueError(
                f"{scheme}: the client needs its trained and the global parameters for its similarity"
            )
        return self.params, self.global_params


@dataclass
class ClientReport:
    """What the server knows about one client after a round of local training.

    name: site name (unique within a round).
    num_samples: N_k, the client's number of training samples (> 0).
    num_steps: tau_k, local optimisation steps taken this round (>= 1; FedNova).
    scalars: client-computed statistics: "similarity", "skew", "imbalance", "discrepancy".
    params: the client's full parameters after local training (plaintext mode only).
    """

    name: str
    num_samples: int
    num_steps: int = 1
    scalars: dict[str, float] = field(default_factory=dict)
    params: dict[str, np.ndarray] | None = None


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_round(round_index: int, num_rounds: int) -> None:
    """Raise ValueError unless 1 <= round_index <= num_rounds (rounds are 1-based)."""
    if not _is_int(num_rounds) or num_rounds < 1:
        raise ValueError(f"num_rounds must be an integer >= 1, got {num_rounds!r}")
    if not _is_int(round_index) or not 1 <= round_index <= num_rounds:
        raise ValueError(f"round_index must be an integer in 1..{num_rounds} (1-based), got {round_index!r}")


def check_reports(
    reports: Sequence[ClientReport],
    *,
    scheme: str,
    scalars: Sequence[str] = (),
    params: bool = False,
) -> np.ndarray:
    """Validate one round's reports and return N_k as a float64 vector.

    Raises ValueError for: no reports; a duplicate site name; N_k or tau_k that is not a positive
    integer; a reported scalar that is not a finite number; a missing required scalar; missing
    parameters when ``params`` is true. Every message names the scheme and the client.
    """
    if reports is None or len(reports) == 0:
        raise ValueError(f"{scheme}: no client reports for this round")
    seen: set[str] = set()
    sizes = np.empty(len(reports))  # float64
    for i, rep in enumerate(reports):
        if not isinstance(rep, ClientReport):
            raise ValueError(f"{scheme}: report #{i} is a {type(rep).__name__}, expected ClientReport")
        who = f"{scheme}: client {rep.name!r}"
        if rep.name in seen:
            raise ValueError(f"{who} reported twice in one round")
        seen.add(rep.name)
        if not _is_int(rep.num_samples) or rep.num_samples <= 0:
            raise ValueError(f"{who}: num_samples must be a positive integer, got {rep.num_samples!r}")
        if not _is_int(rep.num_steps) or rep.num_steps <= 0:
            raise ValueError(f"{who}: num_steps must be a positive integer, got {rep.num_steps!r}")
        for key, value in rep.scalars.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"{who}: scalar {key!r} is not a number: {value!r}") from None
            if not math.isfinite(number):
                raise ValueError(f"{who}: scalar {key!r} is not finite: {number!r}")
        for key in scalars:
            if key not in rep.scalars:
                raise ValueError(
                    f"{who}: missing required scalar {key!r} (reported: {sorted(rep.scalars) or 'none'})"
                )
        if params and rep.params is None:
            raise ValueError(f"{who}: sent no parameters, but this scheme needs plaintext client parameters")
        sizes[i] = float(rep.num_samples)
    return sizes


def scalar_vector(reports: Sequence[ClientReport], key: str, *, scheme: str, nonnegative: bool) -> np.ndarray:
    """The reported scalar ``key`` of every client as float64 (reports already validated)."""
    values = np.array([float(rep.scalars[key]) for rep in reports], dtype=np.float64)
    if nonnegative:
        for rep, v in zip(reports, values, strict=True):
            if v < 0:
                raise ValueError(
                    f"{scheme}: client {rep.name!r}: scalar {key!r} must be >= 0, got {float(v)!r} "
                    "(if the scalar is noised for privacy, clip it to its valid range before sending)"
                )
    return values


def as_distribution(weights: np.ndarray, names: Sequence[str], *, scheme: str) -> np.ndarray:
    """The weights a round applies: w_k / sum_j w_j, non-negative and summing to 1.

    A scheme may give weights that do not sum to 1 (FedNova's tau_eff p_k / ||a_k||_1); as a step
    size above 1 they let one forged step count blow the global model up, so the round applies
    their proportions only. Float noise below 1e-12 of the total is taken as 0. ValueError naming
    the scheme (and the site) for a weight that is not finite, a negative weight or a zero total.
    """
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.size != len(names):
        raise ValueError(f"{scheme}: {w.size} weight(s) for {len(names)} site(s)")
    for name, wk in zip(names, w, strict=True):
        if not math.isfinite(float(wk)):
            raise ValueError(f"{scheme}: the weight of {name!r} is not finite ({float(wk)!r})")
    total = float(w.sum())
    if not total > 0 or not math.isfinite(total):
        raise ValueError(f"{scheme}: the weights sum to {total!r}, not a positive number")
    for name, wk in zip(names, w, strict=True):
        if wk < -1e-12 * total:
            raise ValueError(f"{scheme}: the weight of {name!r} is negative ({float(wk)!r})")
    out = np.maximum(w, 0.0) / total
    return out / out.sum()


def softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable softmax of a vector."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - np.max(z)
    e = np.exp(z)
    return e / e.sum()


def check_params_match(
    name: str, params: Mapping[str, np.ndarray], global_params: Mapping[str, np.ndarray]
) -> None:
    """Raise ValueError naming the client and key if its parameters differ in keys or shapes."""
    check_same_layout(f"client {name!r}", params, global_params, finite=False)


def _first_nonfinite(reports: Sequence[ClientReport], key: str) -> str:
    for rep in reports:
        assert rep.params is not None
        if not np.all(np.isfinite(rep.params[key])):
            return rep.name
    return "<global parameters>"


@dataclass(kw_only=True)
class WeightingScheme(ABC):
    """Base class of every server-side weighting scheme.

    Class attributes declare what a scheme needs (a mode-dependent scheme may override them per
    instance): ``needs_global_histogram`` (clients need the securely aggregated global label
    histogram), ``he_compatible`` (usable when updates are homomorphically encrypted, i.e. the scheme
    weights without plaintext client models; ``he_refusal`` says why not), ``required_scalars``
    (client-reported scalars) and ``he_client_scalars`` (what clients must report under HE instead of
    the server computing it). :meth:`scalars`, :meth:`check_he` and :attr:`fedprox_mu` read them.

    integer_buffers: how ``aggregate`` treats non-float arrays such as BatchNorm's
        ``num_batches_tracked``: "weighted" (default) adds round(sum_k w_k (b_k - b_g)) to the global
        value, the same rule as float arrays rounded to the integer grid; "max" takes the element-wise
        maximum over the clients.
    """

    name: ClassVar[str] = ""
    needs_global_histogram: ClassVar[bool] = False
    he_compatible: ClassVar[bool] = True
    required_scalars: ClassVar[tuple[str, ...]] = ()
    #: Scalars the server computes from plaintext parameters when a client does not report them;
    #: under HE every client must report them (FedDRAW's similarity).
    he_client_scalars: ClassVar[tuple[str, ...]] = ()
    #: Why the scheme cannot run under HE (shown when a job asks for it; empty if it can).
    he_refusal: ClassVar[str] = ""
    #: Valid range of each scalar the scheme reads, where it differs from :data:`SCALAR_RANGES`.
    scalar_ranges: ClassVar[dict[str, tuple[float, float]]] = {}

    integer_buffers: IntegerBufferRule = "weighted"
    #: Intermediate quantities of the last ``weights`` call (for logging; not state).
    last_details: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.integer_buffers not in ("weighted", "max"):
            raise ValueError(f"integer_buffers must be 'weighted' or 'max', got {self.integer_buffers!r}")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name and cls.__module__.startswith("fedweigh.weighting."):
            _DEFINED[cls.name] = cls

    # ----------------------------------------------------------------------------------- needs
    @property
    def fedprox_mu(self) -> float:
        """The proximal coefficient mu the clients add to their loss, (mu / 2) ||theta - theta_g||^2 (0: none)."""
        return 0.0

    def scalars(self, *, encrypted: bool = False) -> tuple[str, ...]:
        """The scalars every client must report: the scheme's own, and under HE (``encrypted``) also
        those the server would otherwise compute from plaintext parameters (``he_client_scalars``)."""
        extra = self.he_client_scalars if encrypted and self.he_compatible else ()
        return tuple(dict.fromkeys([*self.required_scalars, *extra]))

    def scalar_range(self, name: str) -> tuple[float, float]:
        """(lowest, highest) valid value of the client scalar ``name`` for this scheme (both inclusive)."""
        return self.scalar_ranges.get(name, SCALAR_RANGES.get(name, (-math.inf, math.inf)))

    def check_he(self) -> None:
        """Raise :class:`HEIncompatibleScheme` naming the scheme and the reason if it cannot run under HE."""
        if self.he_compatible:
            return
        reason = self.he_refusal or f"{self.name} needs the clients' plaintext parameters at the server"
        raise HEIncompatibleScheme(
            f"scheme {self.name!r} cannot run with homomorphically encrypted updates (he=True): {reason}. "
            "Under HE the server sees only ciphertexts and scalars. Choose a scheme that weights from "
            f"sample counts, steps and client-reported scalars ({', '.join(he_capable_schemes())}), "
            "or run without HE."
        )

    # ----------------------------------------------------------------------------------- client side
    def client_scalars(self, ctx: ScalarContext) -> dict[str, float]:
        """The scalars the CLIENT computes from ``ctx`` and reports for this scheme (default: none)."""
        return {}

    # ----------------------------------------------------------------------------------- server side
    @abstractmethod
    def weights(
        self,
        reports: Sequence[ClientReport],
        global_params: dict[str, np.ndarray] | None,
        round_index: int,
        num_rounds: int,
    ) -> np.ndarray:
        """One float64 weight per report, in report order, acting on deltas (round_index is 1-based)."""

    def aggregate(
        self,
        global_params: dict[str, np.ndarray],
        reports: Sequence[ClientReport],
        weights: np.ndarray,
    ) -> dict[str, np.ndarray]:
        """theta_g + sum_k w_k (theta_k - theta_g), key by key; returns new arrays, inputs untouched.

        Float arrays are accumulated in float64 and returned in their own dtype (float32 stays
        float32): the weighted mean sum_k w_k theta_k rounded once (the round step passes the sites in
        site order, so the sum does not depend on which answered first). Stock NVFlare FedAvg accumulates float32 parameters in float32, in the order the results
        arrive; the two agree bit for bit when its sums are exact (two sites with equal weights) and
        otherwise differ by float32 rounding, which local training can amplify over rounds.
        Non-float arrays follow ``integer_buffers``.
        """
        if global_params is None:
            raise ValueError(f"{self.name}: aggregate needs the global parameters")
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (len(reports),):
            raise ValueError(f"{self.name}: {w.size} weight(s) for {len(reports)} report(s)")
        if not np.all(np.isfinite(w)):
            raise ValueError(f"{self.name}: weights are not all finite: {w.tolist()}")
        for rep in reports:
            if rep.params is None:
                raise ValueError(
                    f"{self.name}: client {rep.name!r} sent no parameters; plaintext aggregation needs them "
                    "(under HE the weighted sum is formed on ciphertexts instead)"
                )
            check_params_match(rep.name, rep.params, global_params)
        out: dict[str, np.ndarray] = {}
        for key, g in global_params.items():
            g = np.asarray(g)
            if np.issubdtype(g.dtype, np.floating):
                g64 = g.astype(np.float64)
                acc = np.zeros_like(g64)
                buf = np.empty_like(g64)
                for rep, wk in zip(reports, w, strict=True):
                    assert rep.params is not None
                    np.subtract(rep.params[key], g64, out=buf)
                    buf *= wk
                    acc += buf
                acc += g64
                if not np.all(np.isfinite(acc)):
                    raise ValueError(
                        f"{self.name}: non-finite values in parameter {key!r} from client "
                        f"{_first_nonfinite(reports, key)!r}"
                    )
                out[key] = acc.astype(g.dtype, copy=False)
            else:
                out[key] = self._aggregate_integer(key, g, reports, w)
        return out

    def _aggregate_integer(
        self, key: str, g: np.ndarray, reports: Sequence[ClientReport], w: np.ndarray
    ) -> np.ndarray:
        stack = [np.asarray(rep.params[key]) for rep in reports if rep.params is not None]
        if self.integer_buffers == "max":
            # each array has g's shape (check_params_match) and, cast, its dtype; asarray: a 0-d one
            return np.asarray(np.maximum.reduce([s.astype(g.dtype) for s in stack]))
        delta = np.zeros(g.shape)  # float64
        g64 = g.astype(np.float64)
        for s, wk in zip(stack, w, strict=True):
            delta += wk * (s.astype(np.float64) - g64)
        return (g64 + np.rint(delta)).astype(g.dtype)

    # ----------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """Cross-round state, JSON-serialisable (default: stateless)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (default: stateless, accepts {})."""
        if not isinstance(state, dict):
            raise ValueError(f"{self.name}: state must be a dict, got {type(state).__name__}")


#: Every scheme class of the package by registry name, as its module defines it (the registry,
#: :data:`fedweigh.weighting.SCHEMES`, lists them in table order).
_DEFINED: dict[str, type[WeightingScheme]] = {}


def he_capable_schemes() -> tuple[str, ...]:
    """Registry names of the schemes that run under HE with their default options, sorted (each
    instance decides, ``he_compatible``: FedDRAW does unless ``similarity="delta"``)."""
    return tuple(sorted(name for name, cls in _DEFINED.items() if cls().he_compatible))
