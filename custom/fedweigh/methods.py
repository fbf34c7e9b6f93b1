"""The method catalogue: every method fedweigh runs, declared once.

A federated method is a weighting scheme at the server plus, where the method prescribes one, a
client loss: FedBB = CBR weights + PNB loss (Chung et al.), DAFL = DAFL weights + DAFL loss (Li et
al.), FedDRAW and the seven baselines keep the dataset's default loss (BCE / CE). What a method needs
follows from its parts, which declare it themselves:

- the label-statistics phase runs when the scheme needs the global histogram
  (``WeightingScheme.needs_global_histogram``: FedDisco) or the loss reads it
  (``ClientLoss.uses_global_stats``: PNB, DAFL, class-balanced);
- HE support and the scalars clients report come from the scheme (``he_compatible``,
  ``scalars(encrypted=...)``), so FedDRAW with ``similarity="delta"`` is refused under HE.

The NVFlare recipes (:mod:`fedweigh.flare.recipes`), the job catalogue (:mod:`fedweigh.flare.jobs`) and
the benchmark (:mod:`fedweigh.bench`) all read :data:`METHODS`. Two references train without
federation: ``centralized`` (all sites' data pooled) and ``local`` (every site alone).

A method label may carry scheme options after a colon, for sensitivity studies::

    feddraw:beta_max=2.0,rho=0.5    ->  scheme "feddraw" with {"beta_max": 2.0, "rho": 0.5}
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Literal

from fedweigh.losses import loss_uses_global_stats
from fedweigh.weighting import SCHEMES, WeightingScheme, get_scheme

Kind = Literal["federated", "centralized", "local"]


@dataclass(frozen=True)
class Method:
    """One federated method of the catalogue: its scheme, its client loss and a one-line description."""

    name: str
    scheme: str
    loss: str = "default"
    description: str = ""

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"method {self.name!r}: unknown scheme {self.scheme!r}")


#: The federated methods, in the order tables list them: FedDRAW, FedBB, DAFL, then the seven baselines.
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("feddraw", "feddraw", description="size prior + cosine-similarity reputation, two schedules"),
        Method(
            "fedbb", "cbr", "pnb", description="Client Balanced Reweighting + Positive-Negative Balanced loss"
        ),
        Method(
            "dafl", "dafl", "dafl", description="distribution-aware aggregation + dynamic adaptive focal loss"
        ),
        Method("fedavg", "fedavg", description="w_k = N_k / N"),
        Method("fedprox", "fedprox", description="FedAvg weights + proximal term at the clients"),
        Method("fednova", "fednova", description="normalised averaging by local steps"),
        Method("fedadp", "fedadp", description="angle-based adaptive weights"),
        Method("ida", "ida", description="inverse distance to the mean model"),
        Method("feddisco", "feddisco", description="size and label-discrepancy weights"),
        Method("fedawa", "fedawa", description="adaptive weights optimised on client vectors"),
    )
}

FEDERATED_METHODS: tuple[str, ...] = tuple(METHODS)

#: The seven federated baselines FedDRAW is compared with.
BASELINES: tuple[str, ...] = ("fedavg", "fedprox", "fednova", "fedadp", "ida", "feddisco", "fedawa")

#: Reference points trained without federation.
REFERENCE_METHODS: tuple[str, ...] = ("centralized", "local")

ALL_METHODS: tuple[str, ...] = FEDERATED_METHODS + REFERENCE_METHODS


@dataclass(frozen=True)
class MethodSpec:
    """A configured method: how the server weights and which loss the sites train with.

    label: the name in tables and file names (e.g. ``feddraw`` or ``feddraw:beta_max=2.0``).
    kind: ``federated``, ``centralized`` or ``local``.
    scheme / scheme_args: the weighting scheme (federated only).
    loss / loss_options: the client loss (``default`` = BCE / CE).
    """

    label: str
    kind: Kind
    scheme: str | None = None
    scheme_args: dict = field(default_factory=dict)
    loss: str = "default"
    loss_options: dict = field(default_factory=dict)

    @property
    def base(self) -> str:
        """The method name without options (``feddraw`` for ``feddraw:beta_max=2``)."""
        return self.label.split(":", 1)[0]

    def make_scheme(self) -> WeightingScheme:
        """A fresh instance of the configured scheme (ValueError for a reference method)."""
        if self.scheme is None:
            raise ValueError(f"method {self.label!r} trains without federation and has no weighting scheme")
        return get_scheme(self.scheme, **self.scheme_args)

    def needs_statistics(self) -> bool:
        """Whether the label-statistics phase runs before training (scheme or loss needs the histogram)."""
        if self.kind != "federated" or self.scheme is None:
            return False
        return needs_statistics(self.make_scheme(), self.loss)

    def as_dict(self) -> dict:
        return {
            "label": self.label,
            "kind": self.kind,
            "scheme": self.scheme,
            "scheme_args": dict(self.scheme_args),
            "loss": self.loss,
            "loss_options": dict(self.loss_options),
        }


def needs_statistics(scheme: WeightingScheme, loss: str) -> bool:
    """The catalogue's rule: the statistics phase runs when the scheme or the loss reads the histogram."""
    return bool(scheme.needs_global_histogram) or loss_uses_global_stats(loss)


def method_spec(name: str, scheme_args: dict | None = None, loss_options: dict | None = None) -> MethodSpec:
    """The :class:`MethodSpec` of catalogue method ``name`` with options (ValueError naming the known methods)."""
    if name in REFERENCE_METHODS:
        return MethodSpec(label=name, kind=name)  # type: ignore[arg-type]
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(ALL_METHODS)}")
    method = METHODS[name]
    options = dict(scheme_args or {})
    known = sorted(f.name for f in dataclasses.fields(SCHEMES[method.scheme]) if f.init)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(
            f"method {name!r}: unknown option(s) {', '.join(unknown)} of scheme {method.scheme!r}; "
            f"its options: {', '.join(known)}"
        )
    try:
        get_scheme(method.scheme, **options)  # fails here, naming the scheme's options, on a bad option
    except TypeError as e:
        raise ValueError(f"method {name!r}: {e}") from None
    return MethodSpec(
        label=name,
        kind="federated",
        scheme=method.scheme,
        scheme_args=options,
        loss=method.loss,
        loss_options=dict(loss_options or {}),
    )


def _parse_options(label: str, text: str) -> dict:
    options: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"method {label!r}: option {item!r} is not of the form key=value")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw.strip()
        options[key.strip()] = value
    return options


def parse_method(label: str) -> MethodSpec:
    """The :class:`MethodSpec` of a method label (``name`` or ``name:key=value,...``).

    Raises ValueError naming the known methods for an unknown name, and the scheme's own error for
    an unknown or invalid option.
    """
    name, _, opts = label.partition(":")
    name = name.strip()
    if name in REFERENCE_METHODS and opts:
        raise ValueError(f"method {label!r}: the reference {name!r} takes no options")
    spec = method_spec(name, _parse_options(label, opts))
    return (
        spec
        if spec.kind != "federated"
        else MethodSpec(
            label=label.strip(),
            kind="federated",
            scheme=spec.scheme,
            scheme_args=spec.scheme_args,
            loss=spec.loss,
        )
    )


__all__ = [
    "ALL_METHODS",
    "BASELINES",
    "FEDERATED_METHODS",
    "METHODS",
    "REFERENCE_METHODS",
    "Method",
    "MethodSpec",
    "method_spec",
    "needs_statistics",
    "parse_method",
]
