"""The scenario catalogue: 12 named client partitions, the same for every dataset (data, not code).

Following FedDRAW's protocol of 12 simulated client-partition scenarios, the catalogue covers IID,
quantity skew, label-distribution skew, per-site acquisition shift, their combinations and three
client counts (4, 8 and 50 sites, the last with 10% of sites sampled per round as in FedBB's appendix).

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

Sites below m rows are topped up deterministically with random rows of the currently largest site.
m = min(32, n // (2K)) (at least 2) so that the 50-site scenario also fits small pools.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from fedweigh.data.base import Federation, LabeledImages, SiteData, Task
from fedweigh.data.pools import load_pool
from fedweigh.data.shift import apply_acquisition_shift, site_profile

Partition = Literal["iid", "quantity", "label", "quantity+label"]
PARTITIONS: tuple[str, ...] = ("iid", "quantity", "label", "quantity+label")

#: Preferred minimum images per site (two batches of 16); lowered to n // (2K) for small pools.
MIN_SITE_SIZE = 32

# Independent random streams derived from the user's seed: np.random.default_rng([seed, STREAM, ...]).
_PARTITION, _VAL_SPLIT, _SHIFT_NOISE, _TEST_SITE = 1, 2, 3, 4


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

    def __post_init__(self) -> None:
        where = f"scenario {self.name!r}"
        if self.num_sites < 1:
            raise ValueError(f"{where}: num_sites must be >= 1, got {self.num_sites}")
        if self.partition not in PARTITIONS:
            raise ValueError(f"{where}: partition must be one of {PARTITIONS}, got {self.partition!r}")
        if self.partition == "iid" and (self.alpha is not None or self.quantity_alpha is not None):
            raise ValueError(f"{where}: an iid partition takes no alpha")
        if self.partition != "iid" and not (self.alpha is not None and self.alpha > 0):
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

    @property
    def site_names(self) -> list[str]:
        """Site names site-1 .. site-K, as the NVFlare simulator names its clients."""
        return [f"site-{k + 1}" for k in range(self.num_sites)]


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
        name="label-shift",
        description="label skew Dirichlet(0.5) + acquisition shift, 4 sites",
        num_sites=4,
        partition="label",
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
)

#: The catalogue by name, in catalogue order.
SCENARIOS: dict[str, Scenario] = {s.name: s for s in _CATALOGUE}


def list_scenarios() -> list[Scenario]:
    """All scenarios, in catalogue order."""
    return list(SCENARIOS.values())


def get_scenario(name: str) -> Scenario:
    """The scenario called ``name``; KeyError listing the known names otherwise."""
    try:
        return SCENARIOS[name]
    except KeyError:
        raise KeyError(f"unknown scenario {name!r}; known scenarios: {', '.join(SCENARIOS)}") from None


def scenario_table() -> str:
    """The catalogue as an aligned text table, one line per scenario (for ``fedweigh scenarios``)."""
    header = ("name", "sites", "partition", "alpha", "q_alpha", "shift", "sampled/round", "description")
    rows = [header]
    for s in list_scenarios():
        per_round = max(1, round(s.sample_fraction * s.num_sites))
        rows.append(
            (
                s.name,
                str(s.num_sites),
                s.partition,
                "-" if s.alpha is None else f"{s.alpha:g}",
                "-" if s.quantity_alpha is None else f"{s.quantity_alpha:g}",
                f"{s.shift:g}",
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


def partition_indices(labels: np.ndarray, task: Task, scenario: Scenario, seed: int) -> list[np.ndarray]:
    """Rows (int64, sorted) of each of the scenario's sites: disjoint, covering range(len(labels)).

    See the module docstring for the four partitions. Deterministic in (labels, scenario, seed).
    """
    n, k = int(np.asarray(labels).shape[0]), scenario.num_sites
    minimum = min_site_size(n, k)
    rng = np.random.default_rng([seed, _PARTITION])
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
) -> Federation:
    """Partition ``dataset`` by ``scenario`` into sites "site-1".."site-K" plus one global test set.

    Each site's rows are split into train and val (``val_fraction`` of its own rows). With
    ``shift > 0`` site k's images get ``site_profile(k, shift, seed)`` and every test image gets the
    profile of a site drawn uniformly at random (seeded), so the test set mirrors the federation's
    mix. ``loader_options`` go to the dataset's loader (e.g. CheXpert's ``uncertainty``).
    """
    sc = scenario if isinstance(scenario, Scenario) else get_scenario(scenario)
    pool, test = load_pool(dataset, data_path, size, seed, num_images, **(loader_options or {}))
    parts = partition_indices(pool.labels, pool.task, sc, seed)
    sites: list[SiteData] = []
    for k, (name, rows) in enumerate(zip(sc.site_names, parts, strict=True)):
        local = pool.subset(rows)
        if sc.shift > 0:
            profile = site_profile(k, sc.shift, seed)
            images = apply_acquisition_shift(local.images, profile, _derived_seed(seed, _SHIFT_NOISE, k))
            local = _with_images(local, images)
        local.meta.update(site=name, scenario=sc.name, dataset=dataset)
        train, val = _split_train_val(local, sc.val_fraction, np.random.default_rng([seed, _VAL_SPLIT, k]))
        sites.append(SiteData(name=name, train=train, val=val))
    if sc.shift > 0 and len(test):
        owner = np.random.default_rng([seed, _TEST_SITE]).integers(sc.num_sites, size=len(test))
        images = np.empty_like(test.images)
        for k in np.unique(owner):
            rows = owner == k
            profile = site_profile(int(k), sc.shift, seed)
            images[rows] = apply_acquisition_shift(
                test.images[rows], profile, _derived_seed(seed, _SHIFT_NOISE, int(k), 1)
            )
        test = _with_images(test, images)
    test = _with_images(test, test.images, scenario=sc.name, dataset=dataset, split="test")
    return Federation(scenario=sc.name, sites=sites, test=test, sample_fraction=sc.sample_fraction)
