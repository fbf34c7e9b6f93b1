"""The method catalogue: every method fedweigh runs, declared once.

A federated method is a weighting scheme at the server plus, where the method prescribes one, a
client loss: FedBB = CBR weights + PNB loss (Chung et al.), DAFL = DAFL weights + DAFL loss (Li et
al.), FedDRAW and the seven baselines keep the dataset's default loss (BCE / CE). A catalogue entry
may also prescribe scheme options, loss options and local-training options (``client_options``:
optimizer, learning rate, ...), e.g. ``fedbb-paper``, FedBB with the paper's SGD. What a method
needs follows from its parts, which declare it themselves:

- the label-statistics phase runs when the scheme needs the global histogram
  (``WeightingScheme.needs_global_histogram``: FedDisco) or the loss reads it
  (``ClientLoss.uses_global_stats``: PNB, DAFL, class-balanced);
- HE support and the scalars clients report come from the scheme (``he_compatible``,
  ``scalars(encrypted=...)``), so FedDRAW with ``similarity="delta"`` is refused under HE.

The NVFlare recipes (:mod:`fedweigh.flare.recipes`), the job catalogue (:mod:`fedweigh.flare.jobs`) and
the benchmark (:mod:`fedweigh.bench`) all read :data:`METHODS`. Two references train without
federation: ``centralized`` (all sites' data pooled) and ``local`` (every site alone).

A method label may carry options after a colon::

    feddraw:beta_max=2.0,rho=0.5        scheme options     {"beta_max": 2.0, "rho": 0.5}
    fedbb:loss.mu=4                     loss options       {"mu": 4}
    fedbb:optim=sgd,lr=0.01,momentum=0.9  client options   {"optimizer": "sgd", "lr": 0.01, "momentum": 0.9}

A key without a prefix is a scheme option when the scheme has it, else a client option
(:data:`CLIENT_OPTIONS`; ``optim`` is short for ``optimizer``); a key both could mean (FedAWA's
server ``lr``) must say which with ``scheme.`` or ``client.``; loss options always take ``loss.``.
The references take client options only (``centralized:optim=sgd,lr=0.01``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from fedweigh.checks import check_client_values
from fedweigh.losses import LOSS_CLASSES, LossContext, build_loss, loss_options, loss_uses_global_stats
from fedweigh.site.args import ClientArgs, method_options
from fedweigh.weighting import SCHEMES, WeightingScheme, get_scheme

__all__ = [
    "ABLATIONS",
    "ALL_METHODS",
    "BASELINES",
    "CLIENT_OPTIONS",
    "CLIENT_OPTION_ALIASES",
    "CONTROLS",
    "FEDBB_PAPER_CLIENT",
    "FEDERATED_METHODS",
    "KNOWN_METHODS",
    "METHODS",
    "REFERENCE_METHODS",
    "VARIANTS",
    "Method",
    "MethodSpec",
    "check_client_options",
    "check_loss_options",
    "check_scheme_options",
    "method_spec",
    "needs_statistics",
    "parse_method",
    "split_options",
]

Kind = Literal["federated", "centralized", "local"]

#: ClientArgs fields a method may prescribe: its local training (declared there, ``method=True``).
#: The data, model, device and privacy settings stay shared by every method of a run.
CLIENT_OPTIONS: tuple[str, ...] = method_options()
#: Short names of client options in method labels.
CLIENT_OPTION_ALIASES: dict[str, str] = {"optim": "optimizer"}
#: Prefixes that say which part of a method an option belongs to.
OPTION_PREFIXES: tuple[str, ...] = ("scheme", "loss", "client")


def _scheme_option_names(scheme: str) -> tuple[str, ...]:
    return tuple(sorted(f.name for f in dataclasses.fields(SCHEMES[scheme]) if f.init))


def check_scheme_options(method: str, scheme: str, options: dict) -> dict:
    """``options`` if scheme ``scheme`` accepts them (names and values), else a one-line ValueError."""
    known = _scheme_option_names(scheme)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(
            f"method {method!r}: unknown option(s) {', '.join(unknown)} of scheme {scheme!r}; "
            f"its options: {', '.join(known)}; client options: {', '.join(CLIENT_OPTIONS)}; "
            "loss options take the prefix loss."
        )
    try:
        get_scheme(scheme, **options)  # fails here, naming the scheme's option, on a bad value
    except (TypeError, ValueError) as e:
        raise ValueError(f"method {method!r}: {e}") from None
    return dict(options)


def check_loss_options(method: str, loss: str, options: dict) -> dict:
    """``options`` if loss ``loss`` accepts their names, and their values for the label statistics
    of either task (:data:`_PROBE_CONTEXTS`); a one-line ValueError otherwise."""
    if not options:
        return {}
    if loss not in LOSS_CLASSES:
        raise ValueError(
            f"method {method!r}: trains with the dataset's default loss (BCE / CE), which takes no options "
            f"(got loss.{', loss.'.join(sorted(options))})"
        )
    known = loss_options(loss)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(
            f"method {method!r}: unknown option(s) {', '.join('loss.' + k for k in unknown)} of loss {loss!r}; "
            f"its options: {', '.join('loss.' + k for k in known)}"
        )
    errors = []
    for ctx in _PROBE_CONTEXTS:  # the values: valid when some task accepts them
        try:
            build_loss(loss, ctx, **options)
            return dict(options)
        except (TypeError, ValueError, KeyError) as e:
            errors.append(str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e))
    raise ValueError(f"method {method!r}: loss options {options} rejected by loss {loss!r}: {errors[0]}")


def _probe_contexts() -> tuple[LossContext, ...]:
    """Small label statistics of either task, to check loss option values before a run."""
    common = {"global_num_samples": 12, "client_level_parameter": 1.0}
    return tuple(
        LossContext(
            task=task,  # type: ignore[arg-type]
            num_classes=3,
            class_counts=np.array([1.0, 2.0, 3.0]),
            num_samples=6,
            global_class_counts=np.array([2.0, 4.0, 6.0]),
            **common,
        )
        for task in ("multilabel", "multiclass")
    )


_PROBE_CONTEXTS = _probe_contexts()


def check_client_options(method: str, options: dict) -> dict:
    """``options`` with aliases resolved, if every name is in :data:`CLIENT_OPTIONS` and every value
    is one :class:`fedweigh.site.args.ClientArgs` accepts; a one-line ValueError otherwise."""
    resolved = {CLIENT_OPTION_ALIASES.get(k, k): v for k, v in options.items()}
    unknown = sorted(set(resolved) - set(CLIENT_OPTIONS))
    if unknown:
        raise ValueError(
            f"method {method!r}: unknown client option(s) {', '.join(unknown)}; "
            f"client options: {', '.join(CLIENT_OPTIONS)} (optim = optimizer)"
        )
    values = {**vars(ClientArgs()), **resolved}
    check_client_values(values, f"method {method!r} client options")  # ConfigError: a ValueError
    return resolved


@dataclass(frozen=True)
class Method:
    """One federated method of the catalogue: its scheme, client loss, the options it prescribes
    for them and for local training (``client_options``, :data:`CLIENT_OPTIONS`), and a description."""

    name: str
    scheme: str
    loss: str = "default"
    description: str = ""
    scheme_args: dict = field(default_factory=dict)
    loss_options: dict = field(default_factory=dict)
    client_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"method {self.name!r}: unknown scheme {self.scheme!r}")
        if self.loss != "default" and self.loss not in LOSS_CLASSES:
            raise ValueError(f"method {self.name!r}: unknown loss {self.loss!r}")


#: FedBB as the paper trains it on chest X-rays (Chung & Lee, Sec. 4 "Implementation Details" and
#: the X-ray paragraph): CBR weights alone (gamma 1), PNB with mu 4, count divisor a (the text's
#: alpha) 10 and beta 0.9999999, local SGD at lr 0.01 with momentum 0.9.
FEDBB_PAPER_CLIENT: dict = {"optimizer": "sgd", "lr": 0.01, "momentum": 0.9}

_CATALOGUE: tuple[Method, ...] = (
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
    # variants: the paper's own settings and the ablations of the two-part methods
    Method(
        "fedbb-paper",
        "cbr",
        "pnb",
        description="FedBB with the paper's chest X-ray settings: gamma 1, PNB a 10 beta 0.9999999, SGD 0.01 m 0.9",
        scheme_args={"gamma": 1.0},
        loss_options={"mu": 4.0, "a": 10.0, "beta": 0.9999999},
        client_options=dict(FEDBB_PAPER_CLIENT),
    ),
    Method("fedbb-pnb", "fedavg", "pnb", description="ablation: FedBB's PNB loss with FedAvg weights"),
    Method("fedbb-cbr", "cbr", description="ablation: FedBB's CBR weights with the default loss (BCE / CE)"),
    Method("dafl-loss", "fedavg", "dafl", description="ablation: DAFL's loss with FedAvg weights"),
    # attribution controls: a gain is credited to a mechanism only when it beats these
    Method("uniform", "uniform", description="control: uniform averaging, w_k = 1/K"),
    Method(
        "feddraw-nosim",
        "feddraw",
        description="control: FedDRAW without the similarity (size prior under both schedules)",
        scheme_args={"similarity": "off"},
    ),
    Method(
        "feddraw-noanneal",
        "feddraw",
        description="control: FedDRAW without the outer annealing (beta_t = beta_max, rho 1)",
        scheme_args={"rho": 1.0},
    ),
)

#: Every catalogue entry by name: the ten methods, then the variants.
METHODS: dict[str, Method] = {m.name: m for m in _CATALOGUE}

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

#: Catalogue entries run by name only (not in the default method lists nor the job catalogue).
VARIANTS: tuple[str, ...] = tuple(m for m in METHODS if m not in FEDERATED_METHODS)

#: The ablations: one part of a two-part method, the other replaced by FedAvg weights or the default loss.
ABLATIONS: tuple[str, ...] = ("fedbb-pnb", "fedbb-cbr", "dafl-loss")

#: The attribution controls: equal weights, and FedDRAW without each of its two mechanisms.
CONTROLS: tuple[str, ...] = ("uniform", "feddraw-nosim", "feddraw-noanneal")

#: The seven federated baselines FedDRAW is compared with.
BASELINES: tuple[str, ...] = ("fedavg", "fedprox", "fednova", "fedadp", "ida", "feddisco", "fedawa")

#: Reference points trained without federation.
REFERENCE_METHODS: tuple[str, ...] = ("centralized", "local")

ALL_METHODS: tuple[str, ...] = FEDERATED_METHODS + REFERENCE_METHODS

#: Every name a method label may start with.
KNOWN_METHODS: tuple[str, ...] = FEDERATED_METHODS + VARIANTS + REFERENCE_METHODS


@dataclass(frozen=True)
class MethodSpec:
    """A configured method: how the server weights, which loss the sites train with, and how.

    label: the name in tables and file names (e.g. ``feddraw`` or ``feddraw:beta_max=2.0``).
    kind: ``federated``, ``centralized`` or ``local``.
    scheme / scheme_args: the weighting scheme (federated only).
    loss / loss_options: the client loss (``default`` = BCE / CE).
    client_options: :class:`fedweigh.site.args.ClientArgs` fields the method sets for local training
        (:data:`CLIENT_OPTIONS`), over the run's shared settings.
    """

    label: str
    kind: Kind
    scheme: str | None = None
    scheme_args: dict = field(default_factory=dict)
    loss: str = "default"
    loss_options: dict = field(default_factory=dict)
    client_options: dict = field(default_factory=dict)

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

    def with_options(self, options: dict) -> MethodSpec:
        """This spec with more options (keys as in a label: ``gamma``, ``loss.mu``, ``lr``, ...), same label."""
        scheme_args, loss_opts, client_opts = split_options(self.label, self.base, options)
        name = self.base if self.kind == "federated" else self.kind
        return method_spec(
            name,
            {**self.scheme_args, **scheme_args},
            {**self.loss_options, **loss_opts},
            {**self.client_options, **client_opts},
            label=self.label,
        )

    def as_dict(self) -> dict:
        out = {
            "label": self.label,
            "kind": self.kind,
            "scheme": self.scheme,
            "scheme_args": dict(self.scheme_args),
            "loss": self.loss,
            "loss_options": dict(self.loss_options),
        }
        if self.client_options:  # absent when empty: records of runs without them stay as they were
            out["client_options"] = dict(self.client_options)
        return out


def needs_statistics(scheme: WeightingScheme, loss: str) -> bool:
    """The catalogue's rule: the statistics phase runs when the scheme or the loss reads the histogram."""
    return bool(scheme.needs_global_histogram) or loss_uses_global_stats(loss)


def method_spec(
    name: str,
    scheme_args: dict | None = None,
    loss_options: dict | None = None,
    client_options: dict | None = None,
    *,
    label: str | None = None,
) -> MethodSpec:
    """The :class:`MethodSpec` of catalogue method ``name``: its prescribed options updated by the
    given ones (ValueError naming the method, the option and what is allowed)."""
    label = label or name
    if name in REFERENCE_METHODS:
        if scheme_args or loss_options:
            raise ValueError(
                f"method {label!r}: the reference {name!r} takes client options only "
                f"({', '.join(CLIENT_OPTIONS)})"
            )
        return MethodSpec(
            label=label,
            kind=name,  # type: ignore[arg-type]
            client_options=check_client_options(label, dict(client_options or {})),
        )
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(KNOWN_METHODS)}")
    method = METHODS[name]
    client = check_client_options(name, {**method.client_options, **(client_options or {})})
    scheme_options = {**method.scheme_args, **(scheme_args or {})}
    if (
        method.scheme == "fednova"
        and client.get("optimizer") == "sgd"
        and "local_optimizer" not in scheme_options
    ):
        # FedNova's normaliser follows the local optimizer the method's clients are given
        scheme_options["local_optimizer"] = "sgd"
        scheme_options.setdefault("momentum", client.get("momentum", ClientArgs().momentum))
    return MethodSpec(
        label=label,
        kind="federated",
        scheme=method.scheme,
        scheme_args=check_scheme_options(name, method.scheme, scheme_options),
        loss=method.loss,
        loss_options=check_loss_options(name, method.loss, {**method.loss_options, **(loss_options or {})}),
        client_options=client,
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


def split_options(label: str, name: str, options: dict) -> tuple[dict, dict, dict]:
    """(scheme options, loss options, client options) of label options (module docstring's rule).

    ValueError naming the method and the key for an unknown prefix or a key both a scheme option and
    a client option could mean.
    """
    scheme_names = _scheme_option_names(METHODS[name].scheme) if name in METHODS else ()
    client_names = set(CLIENT_OPTIONS) | set(CLIENT_OPTION_ALIASES)
    parts: dict[str, dict] = {"scheme": {}, "loss": {}, "client": {}}
    for key, value in options.items():
        prefix, dot, rest = key.partition(".")
        if dot:
            if prefix not in OPTION_PREFIXES or not rest:
                raise ValueError(
                    f"method {label!r}: option {key!r} has an unknown prefix; prefixes: "
                    f"{', '.join(p + '.' for p in OPTION_PREFIXES)}"
                )
            parts[prefix][rest] = value
        elif key in scheme_names and key in client_names:
            raise ValueError(
                f"method {label!r}: option {key!r} is both an option of scheme {METHODS[name].scheme!r} and a "
                f"client option; write scheme.{key} or client.{key}"
            )
        elif key in client_names:
            parts["client"][key] = value
        else:  # a scheme option, or an unknown key the scheme check names
            parts["scheme"][key] = value
    return parts["scheme"], parts["loss"], parts["client"]


def parse_method(label: str) -> MethodSpec:
    """The :class:`MethodSpec` of a method label (``name`` or ``name:key=value,...``).

    Raises ValueError naming the known methods for an unknown name, and naming the method, the key
    and what is allowed for an unknown or invalid option.
    """
    name, _, opts = label.partition(":")
    name = name.strip()
    if name not in KNOWN_METHODS:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(KNOWN_METHODS)}")
    scheme_args, loss_opts, client_opts = split_options(name, name, _parse_options(label, opts))
    return method_spec(name, scheme_args, loss_opts, client_opts, label=label.strip())
