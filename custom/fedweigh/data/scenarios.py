"""The scenario catalogue: 15 named client partitions, the same for every dataset (data, not code).

Following FedDRAW's protocol of simulated client-partition scenarios, the catalogue covers IID,
quantity skew, label-distribution skew, per-site acquisition shift, their combinations and three
client counts (4, 8 and 50 sites, the last with 10% of sites sampled per round as in FedBB's appendix),
plus four scenarios where one site differs from the others in what the weighting schemes claim to
detect: a large site with noisy labels, a small site rich in rare findings, a large site with a degraded
scanner, and a test population mixed differently from the training sizes. Users define their own
scenarios in a file (:mod:`fedweigh.data.scenario_file`).

Partitions (K sites, pool of n rows, m the minimum site size, all draws seeded):

* ``iid``: a random permutation cut into K near-equal parts.
* ``quantity``: site shares w ~ Dir(alpha 1_K); site k gets m + round((n - K m) w_k) rows at random
  (quantity skew of FedBB, Sec. 4: sizes vary, label mix does not).
* ``label``: every row has a group: its class (multi-class) or its *primary label* (multi-label: its
  rarest positive finding by pool prevalence, or an extra "no finding" group). For each group c,
  q_c ~ Dir(alpha 1_K) and the group's rows are shared out in proportions q_c (Hsu et al. 2019;
  Li et al., NIID-Bench 2021). Small alpha -> each site sees few groups.
* ``quantity+label``: as ``label`` with site shares w ~ Dir(quantity_alpha 1_K) as well:
  P(site k | group c) = w_k q_ck / sum_j w_j q_cj.

* ``sites``: every site has its own size (a share of the pool or a count of rows) and label mix
  (:class:`SiteLabels`). Sites with a ``prevalence`` mix draw first, then the others in site order:
  site k wants t_kg = round(n_k pi_kg) rows of primary-label group g, gets min(t_kg, rows of g left)
  and is filled up to n_k with random rows left. pi_k is the pool's group distribution p (``pool``),
  uniform over the groups present (``balanced``: rich in rare findings) or pi_k ~ Dir(alpha p)
  (``alpha``; Hsu et al. 2019's per-client form: alpha -> inf gives p, alpha -> 0 one group).
  What a site asks for must be there: a ``balanced``/``alpha`` site short of t_kg rows of a group, a
  ``prevalence`` site short of round(p_c n_k) positives for c, or a ``pool`` site whose random rows hold
  fewer than t_kg - tol_kg of a group (tol_kg = 4 sqrt(t_kg (1 - p_g)) + 2, beyond the draw's sampling
  spread) raises :class:`~fedweigh.errors.ScenarioShortfall` naming the site and the group; with
  ``shortfall="warn"`` it warns instead and :func:`site_mixes` records what each site got.

Sites below m rows are topped up deterministically with random rows of the currently largest site
(``label`` partitions). m = min(32, n // (2K)) (at least 2) so that the 50-site scenario also fits
small pools.

Per site, after the train/val split: ``label_noise`` r flips labels of the *training* split only
(:func:`flip_labels`; validation and test labels stay clean), and an acquisition profile changes its
images (:mod:`fedweigh.data.shift`). ``test_mix`` decides which site-domain each global test image
comes from (:func:`build_federation`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np

from fedweigh.data.base import Federation, LabeledImages, SiteData, Task
from fedweigh.data.pools import load_pool
from fedweigh.data.shift import AcquisitionProfile, apply_acquisition_shift, degraded_profile, site_profile
from fedweigh.errors import ScenarioShortfall

Partition = Literal["iid", "quantity", "label", "quantity+label", "sites"]
PARTITIONS: tuple[str, ...] = ("iid", "quantity", "label", "quantity+label", "sites")
#: How the global test set is mixed over the sites' domains (see :func:`build_federation`).
TEST_MIXES: tuple[str, ...] = ("pool", "equal", "sizes")
LABEL_MIXES: tuple[str, ...] = ("pool", "balanced", "alpha", "prevalence")
#: What a ``sites`` partition does when a site cannot get the label mix it asks for.
SHORTFALLS: tuple[str, ...] = ("error", "warn")

#: Preferred minimum images per site (two batches of 16); lowered to n // (2K) for small pools.
MIN_SITE_SIZE = 32

# Independent random streams derived from the user's seed: np.random.default_rng([seed, STREAM, ...]).
_PARTITION, _VAL_SPLIT, _SHIFT_NOISE, _TEST_SITE, _LABEL_NOISE, _TEST_MIX = 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class SiteLabels:
    """A site's label mix in a ``sites`` partition (module docstring): ``kind`` is ``pool``,
    ``balanced``, ``alpha`` (with ``alpha`` > 0) or ``prevalence`` (``prevalence``: (class name,
    fraction of the site's rows positive for it) pairs, fractions in [0, 1])."""

    kind: str = "pool"
    alpha: float | None = None
    prevalence: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in LABEL_MIXES:
            raise ValueError(f"label mix must be one of {LABEL_MIXES}, got {self.kind!r}")
        if (self.kind == "alpha") != (self.alpha is not None) or (self.alpha is not None and self.alpha <= 0):
            raise ValueError(
                f"label mix {self.kind!r}: alpha > 0 goes with kind 'alpha' only, got {self.alpha}"
            )
        if (self.kind == "prevalence") != bool(self.prevalence):
            raise ValueError(f"label mix {self.kind!r}: prevalence pairs go with kind 'prevalence' only")
        if any(not 0 <= p <= 1 for _, p in self.prevalence):
            raise ValueError(f"prevalence fractions must be in [0, 1], got {self.prevalence}")

    def describe(self) -> str:
        if self.kind == "alpha":
            return f"Dir({self.alpha:g} p)"
        if self.kind == "prevalence":
            return "prevalence " + ",".join(f"{c}={p:g}" for c, p in self.prevalence)
        return self.kind


@dataclass(frozen=True)
class Scenario:
    """A named client partition; ``alpha`` is the Dirichlet concentration of the partition's skew."""

    name: str
    description: str
    num_sites: int
    partition: Partition
    alpha: float | None = None  # Dirichlet concentration for the skew
    quantity_alpha: float | None = None  # site-size concentration of "quantity+label"
    shift: float = 0.0  # acquisition-shift strength per site (0 = none)
    sample_fraction: float = 1.0  # fraction of sites sampled per round
    val_fraction: float = 0.1
    #: "sites" partition: relative sizes (shares) or absolute row counts, one per site (exactly one given)
    site_shares: tuple[float, ...] | None = None
    site_counts: tuple[int, ...] | None = None
    #: "sites" partition: each site's label mix (None: the pool's at every site)
    site_labels: tuple[SiteLabels, ...] | None = None
    #: per site: fraction r of training labels flipped (flip_labels); None: clean everywhere
    label_noise: tuple[float, ...] | None = None
    #: per site: a shift strength (site_profile(k, s, seed)) or an explicit profile; replaces ``shift``
    site_shift: tuple[float | AcquisitionProfile, ...] | None = None
    #: the global test set's mix of site-domains: "pool", "equal", "sizes" or one share per site
    test_mix: str | tuple[float, ...] = "pool"
    #: site names (None: site-1 .. site-K, as the NVFlare simulator names its clients)
    names: tuple[str, ...] | None = None
    #: "sites" partition: "error" (a site short of its label mix stops the run) or "warn"
    shortfall: str = "error"

    def __post_init__(self) -> None:
        where = f"scenario {self.name!r}"
        if self.shortfall not in SHORTFALLS:
            raise ValueError(f"{where}: shortfall must be one of {SHORTFALLS}, got {self.shortfall!r}")
        if self.num_sites < 1:
            raise ValueError(f"{where}: num_sites must be >= 1, got {self.num_sites}")
        if self.partition not in PARTITIONS:
            raise ValueError(f"{where}: partition must be one of {PARTITIONS}, got {self.partition!r}")
        if self.partition in ("iid", "sites") and (self.alpha is not None or self.quantity_alpha is not None):
            raise ValueError(f"{where}: an {self.partition!r} partition takes no alpha")
        if self.partition not in ("iid", "sites") and not (self.alpha is not None and self.alpha > 0):
            raise ValueError(f"{where}: partition {self.partition!r} needs alpha > 0, got {self.alpha}")
        needs_q = self.partition == "quantity+label"
        if needs_q and not (self.quantity_alpha is not None and self.quantity_alpha > 0):
            raise ValueError(f"{where}: 'quantity+label' needs quantity_alpha > 0, got {self.quantity_alpha}")
        if not needs_q and self.quantity_alpha is not None:
            raise ValueError(f"{where}: quantity_alpha only applies to 'quantity+label' (use alpha)")
        if self.shift < 0:
            raise ValueError(f"{where}: shift must be >= 0, got {self.shift}")
        if not 0 < self.sample_fraction <= 1:
            raise ValueError(f"{where}: sample_fraction must be in (0, 1], got {self.sample_fraction}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"{where}: val_fraction must be in [0, 1), got {self.val_fraction}")
        self._check_per_site(where)

    def _check_per_site(self, where: str) -> None:
        k = self.num_sites
        sized = (self.site_shares is not None) + (self.site_counts is not None)
        if (self.partition == "sites") != (sized == 1) or sized > 1:
            raise ValueError(f"{where}: a 'sites' partition needs exactly one of site_shares, site_counts")
        if self.site_labels is not None and self.partition != "sites":
            raise ValueError(f"{where}: site_labels need partition 'sites', got {self.partition!r}")
        for field_name in ("site_shares", "site_counts", "site_labels", "label_noise", "site_shift", "names"):
            value = getattr(self, field_name)
            if value is not None and len(value) != k:
                raise ValueError(f"{where}: {field_name} needs {k} entries (one per site), got {len(value)}")
        if self.site_shares is not None and any(not w > 0 for w in self.site_shares):
            raise ValueError(f"{where}: site_shares must be > 0, got {self.site_shares}")
        if self.site_counts is not None and any(int(c) != c or c < 2 for c in self.site_counts):
            raise ValueError(f"{where}: site_counts must be integers >= 2, got {self.site_counts}")
        if self.label_noise is not None and any(not 0 <= r < 1 for r in self.label_noise):
            raise ValueError(f"{where}: label_noise must be in [0, 1), got {self.label_noise}")
        if self.site_shift is not None and any(
            not isinstance(v, AcquisitionProfile) and v < 0 for v in self.site_shift
        ):
            raise ValueError(f"{where}: a site_shift strength must be >= 0, got {self.site_shift}")
        if self.site_shift is not None and self.shift:
            raise ValueError(f"{where}: give shift or site_shift, not both")
        if isinstance(self.test_mix, str):
            if self.test_mix not in TEST_MIXES:
                raise ValueError(
                    f"{where}: test_mix must be one of {TEST_MIXES} or shares, got {self.test_mix!r}"
                )
        elif len(self.test_mix) != k or any(w < 0 for w in self.test_mix) or not sum(self.test_mix) > 0:
            raise ValueError(
                f"{where}: test_mix shares need {k} entries >= 0, not all 0, got {self.test_mix}"
            )
        if self.names is not None and len(set(self.names)) != k:
            raise ValueError(f"{where}: site names must be distinct, got {self.names}")

    @property
    def site_names(self) -> list[str]:
        """``names``, or site-1 .. site-K as the NVFlare simulator names its clients."""
        return list(self.names) if self.names else [f"site-{k + 1}" for k in range(self.num_sites)]

    def profiles(self, seed: int) -> list[AcquisitionProfile]:
        """Each site's acquisition profile: ``site_shift`` entries (a strength s gives
        site_profile(k, s, seed)), else site_profile(k, shift, seed) for every site."""
        if self.site_shift is None:
            return [site_profile(k, self.shift, seed) for k in range(self.num_sites)]
        return [
            v if isinstance(v, AcquisitionProfile) else site_profile(k, float(v), seed)
            for k, v in enumerate(self.site_shift)
        ]

    @property
    def has_shift(self) -> bool:
        """Whether any site's images are shifted."""
        if self.site_shift is None:
            return self.shift > 0
        return any(not v.is_identity if isinstance(v, AcquisitionProfile) else v > 0 for v in self.site_shift)


_CATALOGUE: tuple[Scenario, ...] = (
    Scenario(
        name="iid-4",
        description="IID split over 4 sites",
        num_sites=4,
        partition="iid",
    ),
    Scenario(
        name="quantity-a1.0",
        description="quantity skew, Dirichlet(1.0) site sizes, 4 sites",
        num_sites=4,
        partition="quantity",
        alpha=1.0,
    ),
    Scenario(
        name="quantity-a0.3",
        description="strong quantity skew, Dirichlet(0.3) site sizes, 4 sites",
        num_sites=4,
        partition="quantity",
        alpha=0.3,
    ),
    Scenario(
        name="label-a1.0",
        description="mild label skew, Dirichlet(1.0) per primary label, 4 sites",
        num_sites=4,
        partition="label",
        alpha=1.0,
    ),
    Scenario(
        name="label-a0.5",
        description="label skew, Dirichlet(0.5) per primary label, 4 sites",
        num_sites=4,
        partition="label",
        alpha=0.5,
    ),
    Scenario(
        name="label-a0.1",
        description="extreme label skew, Dirichlet(0.1) per primary label, 4 sites",
        num_sites=4,
        partition="label",
        alpha=0.1,
    ),
    Scenario(
        name="shift-4",
        description="IID labels, per-site acquisition shift (strength 1), 4 sites",
        num_sites=4,
        partition="iid",
        shift=1.0,
    ),
    Scenario(
        name="quantity-shift",
        description="quantity skew Dirichlet(0.5) + acquisition shift, 4 sites",
        num_sites=4,
        partition="quantity",
        alpha=0.5,
        shift=1.0,
    ),
    Scenario(
        name="quantity-label",
        description="label skew Dirichlet(0.5) and quantity skew Dirichlet(0.5), 4 sites",
        num_sites=4,
        partition="quantity+label",
        alpha=0.5,
        quantity_alpha=0.5,
    ),
    Scenario(
        name="label-8",
        description="label skew Dirichlet(0.5), 8 sites",
        num_sites=8,
        partition="label",
        alpha=0.5,
    ),
    Scenario(
        name="many-50",
        description="50 sites, label skew Dirichlet(0.5) and quantity skew Dirichlet(1.0), 10% sampled per round",
        num_sites=50,
        partition="quantity+label",
        alpha=0.5,
        quantity_alpha=1.0,
        sample_fraction=0.1,
    ),
    Scenario(
        name="noisy-large",
        description="site-1 holds 55% of the images with 30% of its training labels flipped; 3 clean sites of 15%",
        num_sites=4,
        partition="sites",
        site_shares=(0.55, 0.15, 0.15, 0.15),
        label_noise=(0.3, 0.0, 0.0, 0.0),
    ),
    Scenario(
        name="rare-small",
        description="site-1 holds 10% of the images, clean, every primary label equally often (rich in rare findings)",
        num_sites=4,
        partition="sites",
        site_shares=(0.1, 0.3, 0.3, 0.3),
        site_labels=(SiteLabels("balanced"), SiteLabels(), SiteLabels(), SiteLabels()),
        shortfall="warn",  # the pool holds too few of its rarest findings for an equal share
    ),
    Scenario(
        name="degraded-large",
        description="site-1 holds 55% of the images from a degraded scanner (blur, noise, low contrast)",
        num_sites=4,
        partition="sites",
        site_shares=(0.55, 0.15, 0.15, 0.15),
        site_shift=(degraded_profile(1.0), 0.0, 0.0, 0.0),
        test_mix="sizes",
    ),
    Scenario(
        name="test-mix",
        description="sizes 55/15/15/15%, per-site label mix Dir(0.5 p) and shift; test set equal per site-domain",
        num_sites=4,
        partition="sites",
        site_shares=(0.55, 0.15, 0.15, 0.15),
        site_labels=tuple(SiteLabels("alpha", alpha=0.5) for _ in range(4)),
        site_shift=(1.0, 1.0, 1.0, 1.0),
        test_mix="equal",
        shortfall="warn",  # a Dir(0.5 p) mix often asks for more of one group than the pool holds
    ),
)

#: Scenarios removed from the catalogue: name -> why (``get_scenario`` says so).
REMOVED_SCENARIOS: dict[str, str] = {
    "label-shift": (
        "removed: its partition is label-a0.5's, so it measured only the acquisition shift, which "
        "shift-4 (IID) and quantity-shift (with quantity skew) already measure; "
        "examples/scenarios/label-shift.yaml reproduces it"
    ),
}

#: The catalogue by name, in catalogue order.
SCENARIOS: dict[str, Scenario] = {s.name: s for s in _CATALOGUE}


def list_scenarios() -> list[Scenario]:
    """All scenarios, in catalogue order."""
    return list(SCENARIOS.values())


def get_scenario(name: str) -> Scenario:
    """The scenario called ``name``; KeyError listing the known names otherwise."""
    if name in REMOVED_SCENARIOS:
        raise KeyError(f"scenario {name!r} was {REMOVED_SCENARIOS[name]}")
    try:
        return SCENARIOS[name]
    except KeyError:
        raise KeyError(f"unknown scenario {name!r}; known scenarios: {', '.join(SCENARIOS)}") from None


def _shift_cell(s: Scenario) -> str:
    if s.site_shift is None:
        return f"{s.shift:g}"
    return ",".join(
        ("profile" if not v.is_identity else "0") if isinstance(v, AcquisitionProfile) else f"{v:g}"
        for v in s.site_shift
    )


def scenario_table(scenarios: list[Scenario] | None = None) -> str:
    """Scenarios (default: the catalogue) as an aligned text table, one line each (``fedweigh scenarios``).

    shift: one strength for all sites, or per site (``profile``: an explicit profile such as the
    degraded scanner); noise: the sites' training-label flip rates; test: the test set's domain mix.
    """
    header = (
        "name",
        "sites",
        "partition",
        "alpha",
        "q_alpha",
        "shift",
        "noise",
        "test",
        "sampled/round",
        "description",
    )
    rows = [header]
    for s in list_scenarios() if scenarios is None else scenarios:
        per_round = max(1, round(s.sample_fraction * s.num_sites))
        rows.append(
            (
                s.name,
                str(s.num_sites),
                s.partition,
                "-" if s.alpha is None else f"{s.alpha:g}",
                "-" if s.quantity_alpha is None else f"{s.quantity_alpha:g}",
                _shift_cell(s),
                "-" if s.label_noise is None else ",".join(f"{r:g}" for r in s.label_noise),
                s.test_mix if isinstance(s.test_mix, str) else ",".join(f"{w:g}" for w in s.test_mix),
                f"{s.sample_fraction:.0%} ({per_round})",
                s.description,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def primary_labels(labels: np.ndarray, task: Task) -> np.ndarray:
    """Group id per row for label skew, int64 (N,).

    Multi-class: the class. Multi-label with C findings: the positive finding with the fewest
    positives in ``labels`` (ties: lower index), or C ("no finding") when a row has no positive.
    NaN entries (ignored uncertain labels) count as not positive.
    """
    if task == "multiclass":
        return np.asarray(labels, dtype=np.int64).reshape(-1)
    positive = np.nan_to_num(np.asarray(labels, dtype=np.float64), nan=0.0) > 0.5
    prevalence = positive.sum(axis=0).astype(np.float64)
    score = np.where(positive, prevalence[None, :], np.inf)
    group = score.argmin(axis=1)
    group[~positive.any(axis=1)] = labels.shape[1]
    return group.astype(np.int64)


def min_site_size(n: int, num_sites: int) -> int:
    """Minimum rows per site: min(MIN_SITE_SIZE, n // (2 K)), at least 2 (one train and one val row)."""
    m = max(2, min(MIN_SITE_SIZE, n // (2 * num_sites)))
    if n < m * num_sites:
        raise ValueError(f"{n} images cannot give {num_sites} sites at least {m} images each")
    return m


def _largest_remainder(shares: np.ndarray, total: int) -> np.ndarray:
    """Integer counts summing to ``total`` proportional to ``shares`` (Hamilton's method)."""
    shares = np.asarray(shares, dtype=np.float64)
    if shares.sum() <= 0:
        shares = np.ones_like(shares)
    exact = total * shares / shares.sum()
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    if short > 0:
        counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


def _top_up(parts: list[np.ndarray], minimum: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Move random rows from the largest site to each site below ``minimum`` until all reach it."""
    parts = [p.copy() for p in parts]
    for k in range(len(parts)):
        while len(parts[k]) < minimum:
            donor = int(np.argmax([len(p) for p in parts]))
            take = min(minimum - len(parts[k]), len(parts[donor]) - minimum)
            order = rng.permutation(len(parts[donor]))
            parts[k] = np.concatenate([parts[k], parts[donor][order[:take]]])
            parts[donor] = parts[donor][np.sort(order[take:])]
    return parts


def partition_indices(
    labels: np.ndarray, task: Task, scenario: Scenario, seed: int, class_names: tuple[str, ...] = ()
) -> list[np.ndarray]:
    """Rows (int64, sorted) of each of the scenario's sites: disjoint, covering range(len(labels))
    (a ``sites`` partition with row counts may leave rows unused).

    See the module docstring for the partitions. Deterministic in (labels, scenario, seed).
    ``class_names`` name the label columns (needed by a ``prevalence`` label mix).
    """
    n, k = int(np.asarray(labels).shape[0]), scenario.num_sites
    rng = np.random.default_rng([seed, _PARTITION])
    if scenario.partition == "sites":
        return _partition_sites(labels, task, scenario, rng, class_names)
    minimum = min_site_size(n, k)
    if scenario.partition == "iid":
        parts = np.array_split(rng.permutation(n), k)
    elif scenario.partition == "quantity":
        sizes = minimum + _largest_remainder(rng.dirichlet(np.full(k, scenario.alpha)), n - k * minimum)
        parts = np.split(rng.permutation(n), np.cumsum(sizes)[:-1])
    else:
        weights = np.ones(k)
        if scenario.partition == "quantity+label":
            weights = rng.dirichlet(np.full(k, scenario.quantity_alpha))
        groups = primary_labels(labels, task)
        buckets: list[list[np.ndarray]] = [[] for _ in range(k)]
        for g in np.unique(groups):
            rows = rng.permutation(np.flatnonzero(groups == g))
            shares = rng.dirichlet(np.full(k, scenario.alpha)) * weights
            counts = _largest_remainder(shares, len(rows))
            for site, chunk in enumerate(np.split(rows, np.cumsum(counts)[:-1])):
                buckets[site].append(chunk)
        parts = [np.concatenate(b) if b else np.empty(0, dtype=np.int64) for b in buckets]
        parts = _top_up(parts, minimum, rng)
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def site_sizes(scenario: Scenario, n: int) -> np.ndarray:
    """Rows per site of a ``sites`` partition of n rows: the counts, or round(n w_k / sum w) by
    largest remainders; ValueError when the pool is too small."""
    where = f"scenario {scenario.name!r}"
    if scenario.site_counts is not None:
        sizes = np.asarray(scenario.site_counts, dtype=np.int64)
        if sizes.sum() > n:
            raise ValueError(f"{where}: its sites hold {int(sizes.sum())} images but the pool has only {n}")
    else:
        sizes = _largest_remainder(np.asarray(scenario.site_shares), n)
    if sizes.min() < 2:
        raise ValueError(
            f"{where}: {n} images give site {scenario.site_names[int(sizes.argmin())]} fewer than 2"
        )
    return sizes


def _one_hot(labels: np.ndarray, task: Task, num_classes: int) -> np.ndarray:
    """Positive (bool, N x C): multi-label 0/1 (NaN not positive) or the class as one-hot."""
    if task == "multiclass":
        return np.eye(num_classes, dtype=bool)[np.asarray(labels, dtype=np.int64)]
    return np.nan_to_num(np.asarray(labels, dtype=np.float64), nan=0.0) > 0.5


def _take(candidates: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` (at most all) random rows of the boolean mask ``candidates``."""
    rows = np.flatnonzero(candidates)
    return rng.permutation(rows)[: max(0, min(count, len(rows)))]


def _group_name(g: int, task: Task, class_names: tuple[str, ...]) -> str:
    """A primary-label group's name: its class, or "no finding" (multi-label group C)."""
    if g < len(class_names):
        return class_names[g]
    return "no finding" if task == "multilabel" else f"class {g}"


def _pool_tolerance(target: int, p: float) -> int:
    """Rows a ``pool`` site's random draw may fall short of its target t by: 4 sqrt(t (1 - p)) + 2."""
    return int(np.ceil(4 * np.sqrt(target * (1 - p)))) + 2


def _partition_sites(
    labels: np.ndarray, task: Task, scenario: Scenario, rng: np.random.Generator, class_names: tuple[str, ...]
) -> list[np.ndarray]:
    """The ``sites`` partition (module docstring): exact sizes and label mixes, or a
    :class:`ScenarioShortfall` (a warning with ``shortfall="warn"``) naming the first site that ran short."""
    import warnings

    n, k = int(np.asarray(labels).shape[0]), scenario.num_sites
    sizes = site_sizes(scenario, n)
    mixes = scenario.site_labels or tuple(SiteLabels() for _ in range(k))
    groups = primary_labels(labels, task)
    width = int(groups.max()) + 1 if n else 1
    pool_dist = np.bincount(groups, minlength=width) / max(n, 1)
    free = np.ones(n, dtype=bool)
    parts: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * k
    order = [i for i in range(k) if mixes[i].kind == "prevalence"] + [
        i for i in range(k) if mixes[i].kind != "prevalence"
    ]
    names = scenario.site_names
    short: list[tuple[int, str]] = []
    for rank, site in enumerate(order):
        mix, want = mixes[site], int(sizes[site])
        before = names[site]
        after = [names[i] for i in order[:rank]]
        earlier = f"after {', '.join(after)}" if after else "in the pool"

        def lack(
            what: str, pct: float, target: int, got: str, site: int = site, before: str = before
        ) -> None:
            short.append((site, f"{before} asked for {pct:.0%} {what} ({target} images) but {got}"))

        taken = (
            _prevalence_rows(labels, task, scenario, site, free, want, rng, class_names, lack, earlier)
            if (mix.kind == "prevalence")
            else []
        )
        if mix.kind in ("balanced", "alpha"):
            present = pool_dist > 0
            dist = present.astype(np.float64)
            if mix.kind == "alpha":
                dist[present] = rng.dirichlet(mix.alpha * pool_dist[present])
            target = _largest_remainder(dist, want)
            for g in np.flatnonzero(target):
                left = int((free & (groups == g)).sum())
                rows = _take(free & (groups == g), int(target[g]), rng)
                if len(rows) < target[g]:
                    name = _group_name(int(g), task, class_names)
                    lack(name, target[g] / want, int(target[g]), f"only {left} remain {earlier}")
                free[rows] = False
                taken.append(rows)
        left_before = np.bincount(groups[free], minlength=width)
        rows = _take(free, want - sum(len(t) for t in taken), rng)  # fill up with random rows left
        free[rows] = False
        parts[site] = np.concatenate([*taken, rows]).astype(np.int64)
        if mix.kind == "pool":
            target = _largest_remainder(pool_dist, want)
            got = np.bincount(groups[parts[site]], minlength=width)
            tol = np.array([_pool_tolerance(int(t), p) for t, p in zip(target, pool_dist, strict=True)])
            for g in np.flatnonzero(got < target - tol):
                name = _group_name(int(g), task, class_names)
                lack(
                    f"{name} (the pool's mix)",
                    float(pool_dist[g]),
                    int(target[g]),
                    f"got {int(got[g])} ({int(left_before[g])} remained {earlier})",
                )
    if short:
        first_site, message = short[0]
        others = len(short) - 1
        line = f"scenario {scenario.name!r}: {message}" + (
            f" (and {others} more shortfalls)" if others else ""
        )
        if scenario.shortfall == "error":
            raise ScenarioShortfall(
                scenario.name,
                names[first_site],
                line
                + "; give the sites fewer images of it, or set shortfall: warn to run with what they get",
            )
        for _, message in short:
            warnings.warn(f"scenario {scenario.name!r}: {message}", stacklevel=3)
    return [np.sort(p) for p in parts]


def site_mixes(
    labels: np.ndarray, task: Task, parts: list[np.ndarray], names: list[str], class_names: tuple[str, ...]
) -> dict[str, dict]:
    """What each site really got: ``{site: {"images": n_k, "mix": {group: share of its rows}}}`` by
    primary-label group (:func:`primary_labels`), groups it holds only."""
    groups = primary_labels(labels, task)
    width = int(groups.max()) + 1 if groups.size else 1
    out: dict[str, dict] = {}
    for name, rows in zip(names, parts, strict=True):
        counts = np.bincount(groups[rows], minlength=width)
        out[name] = {
            "images": int(len(rows)),
            "mix": {
                _group_name(g, task, class_names): round(float(counts[g]) / max(len(rows), 1), 4)
                for g in np.flatnonzero(counts)
            },
        }
    return out


def _prevalence_rows(
    labels: np.ndarray,
    task: Task,
    scenario: Scenario,
    site: int,
    free: np.ndarray,
    want: int,
    rng: np.random.Generator,
    class_names: tuple[str, ...],
    lack: object = None,
    earlier: str = "",
) -> list[np.ndarray]:
    """A ``prevalence`` site's rows (marked taken in ``free``): for each listed class c, rarest first,
    round(p_c n_k) rows positive for c in all (as far as the pool holds them), then rows negative for
    every listed class up to n_k. ``lack(what, share, target, got)`` hears of each class short."""
    mix = scenario.site_labels[site]  # type: ignore[index]
    index = {name: c for c, name in enumerate(class_names)}
    unknown = [name for name, _ in mix.prevalence if name not in index]
    if unknown:
        raise ValueError(
            f"scenario {scenario.name!r}: site {scenario.site_names[site]}: unknown class(es) {unknown} in "
            f"prevalence; known: {', '.join(class_names)}"
        )
    positive = _one_hot(labels, task, len(class_names))
    listed = [index[name] for name, _ in mix.prevalence]
    held = np.zeros(len(free), dtype=bool)
    for c, p in sorted(
        zip(listed, (p for _, p in mix.prevalence), strict=True), key=lambda cp: positive[:, cp[0]].sum()
    ):
        need = round(p * want) - int(positive[held, c].sum())
        rows = _take(free & positive[:, c], need, rng)
        if len(rows) < need and callable(lack):
            left = int((free & positive[:, c]).sum())
            lack(f"positive for {class_names[c]}", p, round(p * want), f"only {left} remain {earlier}")
        free[rows] = False
        held[rows] = True
    rows = _take(free & ~positive[:, listed].any(axis=1), want - int(held.sum()), rng)
    free[rows] = False
    held[rows] = True
    return [np.flatnonzero(held)]


def flip_labels(
    labels: np.ndarray, task: Task, rate: float, rng: np.random.Generator, num_classes: int
) -> np.ndarray:
    """Labels with a fraction ``rate`` flipped (a new array).

    Multi-label, per finding c with P_c positives and N_c negatives (NaN entries untouched):
    f_c = min(round(rate P_c), N_c) random positives become 0 and f_c random negatives become 1, so the
    site's label histogram (what FedBB / FedDRAW read) is unchanged while rate P_c of its positive
    labels are wrong. Multi-class: round(rate N) random rows get a different class, uniformly.
    """
    out = np.array(labels, copy=True)
    if rate <= 0 or len(out) == 0:
        return out
    if task == "multiclass":
        rows = rng.permutation(len(out))[: round(rate * len(out))]
        out[rows] = (out[rows] + rng.integers(1, num_classes, size=len(rows))) % num_classes
        return out
    for c in range(out.shape[1]):
        pos, neg = np.flatnonzero(labels[:, c] == 1), np.flatnonzero(labels[:, c] == 0)
        flips = min(round(rate * len(pos)), len(neg))
        out[rng.permutation(pos)[:flips], c] = 0
        out[rng.permutation(neg)[:flips], c] = 1
    return out


def site_label_divergence(labels: np.ndarray, task: Task, parts: list[np.ndarray]) -> np.ndarray:
    """Jensen-Shannon divergence (base 2, in [0, 1]) of each site's primary-label distribution from
    the pool's: JS(P, Q) = (KL(P || M) + KL(Q || M)) / 2 with M = (P + Q) / 2.
    """
    from scipy.spatial.distance import jensenshannon

    groups = primary_labels(labels, task)
    width = int(groups.max()) + 1 if groups.size else 1
    pool = np.bincount(groups, minlength=width)
    return np.array(
        [jensenshannon(np.bincount(groups[rows], minlength=width), pool, base=2) ** 2 for rows in parts]
    )


def _derived_seed(*words: int) -> int:
    return int(np.random.default_rng(list(words)).integers(2**62))


def _split_train_val(
    data: LabeledImages, val_fraction: float, rng: np.random.Generator
) -> tuple[LabeledImages, LabeledImages]:
    """Random train/val split of one site's rows; val gets round(f n) rows, at least 1 when f > 0."""
    n = len(data)
    n_val = 0 if val_fraction == 0 else min(n - 1, max(1, round(val_fraction * n)))
    order = rng.permutation(n)
    return data.subset(np.sort(order[n_val:])), data.subset(np.sort(order[:n_val]))


def _with_images(data: LabeledImages, images: np.ndarray, **meta: object) -> LabeledImages:
    return LabeledImages(
        images=images,
        labels=data.labels,
        class_names=data.class_names,
        task=data.task,
        domain=data.domain,
        meta={**data.meta, **meta},
    )


def build_federation(
    scenario: str | Scenario,
    dataset: str = "synthcxr",
    *,
    data_path: str | Path | None = None,
    size: int = 32,
    seed: int = 0,
    num_images: int | None = None,
    loader_options: dict | None = None,
    test_images: int | None = None,
) -> Federation:
    """Partition ``dataset`` by ``scenario`` into its sites plus one global test set.

    Each site's rows are split into train and val (``val_fraction`` of its own rows); with
    ``label_noise`` r_k > 0, :func:`flip_labels` flips site k's training labels (val and test stay
    clean). Site k's images get its acquisition profile (:meth:`Scenario.profiles`). The test set
    (``test_images`` rows; default: the dataset's, see :func:`fedweigh.data.pools.load_pool`) by
    ``test_mix``:

    * ``pool``: the dataset's test rows; with shift, every test image gets the profile of a site drawn
      uniformly at random (seeded).
    * ``equal`` / ``sizes`` / shares w: site-domain k gets m_k = round(N w_k / sum w) test rows (w_k
      = 1, n_k or the given share), drawn with site k's primary-label mix (t_kg = round(m_k q_kg);
      a group the domains want more of than the test rows hold is shared pro rata; then filled up at
      random), and site k's profile. ``test.domain`` holds k per row.

    ``loader_options`` go to the dataset's loader (e.g. CheXpert's ``uncertainty``).
    """
    sc = scenario if isinstance(scenario, Scenario) else get_scenario(scenario)
    pool, test = load_pool(
        dataset, data_path, size, seed, num_images, test_images=test_images, **(loader_options or {})
    )
    parts = partition_indices(pool.labels, pool.task, sc, seed, pool.class_names)
    profiles = sc.profiles(seed) if sc.has_shift else [AcquisitionProfile()] * sc.num_sites
    noise = sc.label_noise or (0.0,) * sc.num_sites
    got = (
        site_mixes(pool.labels, pool.task, parts, sc.site_names, pool.class_names)
        if sc.partition == "sites" and sc.shortfall == "warn"
        else {}
    )
    sites: list[SiteData] = []
    for k, (name, rows) in enumerate(zip(sc.site_names, parts, strict=True)):
        local = pool.subset(rows)
        if not profiles[k].is_identity:
            images = apply_acquisition_shift(local.images, profiles[k], _derived_seed(seed, _SHIFT_NOISE, k))
            local = _with_images(local, images)
        local.meta.update(site=name, scenario=sc.name, dataset=dataset)
        if name in got:  # shortfall "warn": what the site really got (the bench records it per cell)
            local.meta["realised"] = got[name]
        train, val = _split_train_val(local, sc.val_fraction, np.random.default_rng([seed, _VAL_SPLIT, k]))
        if noise[k] > 0:
            flipped = flip_labels(
                train.labels,
                train.task,
                noise[k],
                np.random.default_rng([seed, _LABEL_NOISE, k]),
                train.num_classes,
            )
            train = replace(train, labels=flipped, meta={**train.meta, "label_noise": noise[k]})
        sites.append(SiteData(name=name, train=train, val=val))
    if sc.test_mix == "pool":
        test = _pool_test_mix(test, sc, profiles, seed)
    elif len(test):
        test = _site_test_mix(pool, test, parts, sc, profiles, seed)
    test = _with_images(test, test.images, scenario=sc.name, dataset=dataset, split="test")
    return Federation(scenario=sc.name, sites=sites, test=test, sample_fraction=sc.sample_fraction)


def _pool_test_mix(
    test: LabeledImages, sc: Scenario, profiles: list[AcquisitionProfile], seed: int
) -> LabeledImages:
    """``test_mix`` "pool": the test rows as loaded, each image shifted by a uniformly drawn site's profile."""
    if all(p.is_identity for p in profiles) or not len(test):
        return test
    owner = np.random.default_rng([seed, _TEST_SITE]).integers(sc.num_sites, size=len(test))
    images = np.empty_like(test.images)
    for k in np.unique(owner):
        rows = owner == k
        images[rows] = apply_acquisition_shift(
            test.images[rows], profiles[int(k)], _derived_seed(seed, _SHIFT_NOISE, int(k), 1)
        )
    return _with_images(test, images)


def domain_shares(sc: Scenario, site_sizes_: list[int]) -> np.ndarray:
    """The test set's share per site-domain: 1/K (``equal``), n_k / n (``sizes``) or the given shares."""
    if sc.test_mix == "equal":
        w = np.ones(sc.num_sites)
    elif sc.test_mix == "sizes":
        w = np.asarray(site_sizes_, dtype=np.float64)
    else:
        w = np.asarray(sc.test_mix, dtype=np.float64)
    return w / w.sum()


def _site_test_mix(
    pool: LabeledImages,
    test: LabeledImages,
    parts: list[np.ndarray],
    sc: Scenario,
    profiles: list[AcquisitionProfile],
    seed: int,
) -> LabeledImages:
    """``test_mix`` by site-domain (see :func:`build_federation`); rows ordered by domain."""
    rng = np.random.default_rng([seed, _TEST_MIX])
    groups = primary_labels(np.concatenate([pool.labels, test.labels]), pool.task)
    pool_groups, test_groups = groups[: len(pool)], groups[len(pool) :]
    width = int(groups.max()) + 1
    counts = _largest_remainder(domain_shares(sc, [len(p) for p in parts]), len(test))
    wanted = np.stack(
        [
            _largest_remainder(np.bincount(pool_groups[rows], minlength=width), int(counts[k]))
            for k, rows in enumerate(parts)
        ]
    )  # (K, groups): test rows of each group each domain wants
    available = np.bincount(test_groups, minlength=width)
    for g in np.flatnonzero(wanted.sum(axis=0) > available):  # a scarce group: shared pro rata
        wanted[:, g] = _largest_remainder(wanted[:, g], int(available[g]))
    free = np.ones(len(test), dtype=bool)
    chosen, owner = [], []
    for k in range(sc.num_sites):
        taken = []
        for g in np.flatnonzero(wanted[k]):
            picked = _take(free & (test_groups == g), int(wanted[k, g]), rng)
            free[picked] = False
            taken.append(picked)
        chosen.append(taken)
    for k in range(sc.num_sites):  # then fill every domain up to m_k with random rows left
        filler = _take(free, int(counts[k]) - sum(len(t) for t in chosen[k]), rng)
        free[filler] = False
        chosen[k] = np.sort(np.concatenate([*chosen[k], filler]).astype(np.int64))
        owner.append(np.full(len(chosen[k]), k, dtype=np.int64))
    mixed = test.subset(np.concatenate(chosen))
    domain = np.concatenate(owner)
    images = mixed.images
    for k in range(sc.num_sites):
        rows = domain == k
        if rows.any() and not profiles[k].is_identity:
            images[rows] = apply_acquisition_shift(
                images[rows], profiles[k], _derived_seed(seed, _SHIFT_NOISE, k, 1)
            )
    return replace(mixed, images=images, domain=domain)
