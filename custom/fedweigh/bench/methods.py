"""The methods a benchmark compares, defined as the NVFlare recipes define them.

A federated method is a weighting scheme at the server plus, where the method prescribes one, a
client loss (``fedweigh.flare.recipes``): FedBB = CBR weights + PNB loss, DAFL = DAFL weights + DAFL
loss, every other method keeps the dataset's default loss (BCE / CE). The label-statistics phase runs
when the scheme needs the global histogram (FedDisco) or the loss uses it (PNB, DAFL, class-balanced),
as the recipes set it up.

Two references train without federation: ``centralized`` (all sites' data pooled) and ``local``
(every site alone; the mean over sites is reported).

A method label may carry scheme options after a colon, for sensitivity studies::

    feddraw:beta_max=2.0,rho=0.5    ->  scheme "feddraw" with {"beta_max": 2.0, "rho": 0.5}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["federated", "centralized", "local"]

#: Losses that read the global label histogram from the statistics phase (as in the recipes).
LOSSES_NEEDING_GLOBAL_STATS: tuple[str, ...] = ("pnb", "dafl", "class_balanced")

#: The federated methods, in the order tables list them: FedDRAW, FedBB, DAFL, then the seven baselines.
FEDERATED_METHODS: tuple[str, ...] = (
    "feddraw",
    "fedbb",
    "dafl",
    "fedavg",
    "fedprox",
    "fednova",
    "fedadp",
    "ida",
    "feddisco",
    "fedawa",
)

#: Reference points trained without federation.
REFERENCE_METHODS: tuple[str, ...] = ("centralized", "local")

ALL_METHODS: tuple[str, ...] = FEDERATED_METHODS + REFERENCE_METHODS

#: method -> (weighting scheme, client loss); "default" = the dataset's BCE / CE.
_RECIPE_TABLE: dict[str, tuple[str, str]] = {
    "feddraw": ("feddraw", "default"),
    "fedbb": ("cbr", "pnb"),
    "dafl": ("dafl", "dafl"),
    **{b: (b, "default") for b in ("fedavg", "fedprox", "fednova", "fedadp", "ida", "feddisco", "fedawa")},
}


@dataclass(frozen=True)
class MethodSpec:
    """One column of the benchmark: how the server weights and which loss the sites train with.

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

    def needs_statistics(self) -> bool:
        """Whether the label-statistics phase runs before training (the recipes' rule)."""
        if self.kind != "federated" or self.scheme is None:
            return False
        from fedweigh.weighting import get_scheme

        scheme = get_scheme(self.scheme, **self.scheme_args)
        return bool(scheme.needs_global_histogram) or self.loss in LOSSES_NEEDING_GLOBAL_STATS

    def as_dict(self) -> dict:
        return {
            "label": self.label,
            "kind": self.kind,
            "scheme": self.scheme,
            "scheme_args": dict(self.scheme_args),
            "loss": self.loss,
            "loss_options": dict(self.loss_options),
        }


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
    if name in REFERENCE_METHODS:
        if opts:
            raise ValueError(f"method {label!r}: the reference {name!r} takes no options")
        return MethodSpec(label=name, kind=name)  # type: ignore[arg-type]
    if name not in _RECIPE_TABLE:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(ALL_METHODS)}")
    scheme, loss = _RECIPE_TABLE[name]
    options = _parse_options(label, opts)
    from fedweigh.weighting import get_scheme

    get_scheme(scheme, **options)  # fails here, naming the scheme's options, on a bad option
    return MethodSpec(label=label.strip(), kind="federated", scheme=scheme, scheme_args=options, loss=loss)
