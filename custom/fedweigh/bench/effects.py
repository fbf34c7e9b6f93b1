"""How much a method beats FedAvg: paired bootstrap intervals, the seed noise floor, the plateau check.

- **Paired bootstrap over test images.** All methods of a (scenario, seed) share one test set, so a
  method's test macro AUC and FedAvg's are compared on the same resamples of it. For resample b,
  every test image i of seed s is drawn w_bi times (multinomial counts, sum N_s); the difference
  D_s^b = AUC_method(w^b) - AUC_fedavg(w^b) is averaged over the seeds,
  D^b = mean_s D_s^b, and the 95% interval is the 2.5th and 97.5th percentile of D^1..D^B.
  The effect itself is mean_s (AUC_method - AUC_fedavg) on the full test sets.
  The counts come from ``numpy.random.default_rng([bootstrap_seed, s])``: every method of a
  (scenario, seed) sees the same resamples, and a rerun the same interval.
- A finding (class) whose resample holds only positives or only negatives has no AUC: it is left out
  of that resample's macro average, for the method and FedAvg alike (they share the labels).
  A resample in which no finding qualifies is left out of the interval.
- AUC with counts w (ties count one half, the Mann-Whitney form of ``roc_auc_score``):
  AUC_j = sum_{pos p, neg n} w_p w_n ([s_p > s_n] + [s_p = s_n] / 2) / (W_pos W_neg).
- **Noise floor** (``noise_floor``): per scenario and method, the standard deviation across seeds
  (ddof 1) of the final test AUC; the floor is their mean over scenarios and methods. It needs at
  least two seeds.
- **Plateau** (``plateau_reached``): a cell reached its plateau when its test AUC gained less than
  ``tol`` over the last third of its rounds, AUC(T) - AUC(t0) < tol with t0 the last scored round at
  or before floor(2T / 3); undefined when t0 is round 0 (then nothing separates training from the
  plateau: ``local`` is scored at rounds 0 and T only).

The bootstrap above covers **test-set sampling only**. Training noise (a new seed) is in:

- **Endpoints** (``endpoint_scores``): ``final`` = the test AUC at round T; ``last_k`` = the mean test
  AUC over the last ``LAST_K`` scored rounds after round 0 (fewer when the run scored fewer), a
  steadier figure than one round's.
- **Seed-paired effects** (``seed_effects``): per scenario the paired t interval over seeds of
  d_s = endpoint_method(s) - endpoint_reference(s) (:func:`fedweigh.bench.stats.paired_t_interval`),
  and across scenarios the DerSimonian-Laird random-effects estimate with v_i = SE_i^2
  (:func:`fedweigh.bench.stats.dersimonian_laird`). Verdicts (``verdict``) use these intervals.
- **Paired noise floor** (``paired_noise_floor``): per method, the mean over scenarios of the standard
  deviation across seeds (ddof 1) of d_s: how far the effect itself moves with the seed.
- **Common and rare findings** (``finding_group_aucs``, multi-label only): the rare findings are the
  ceil(C / 4) findings with the lowest prevalence among the test labels (ties: the first listed);
  the common ones the others; each group's AUC is the mean of its findings' AUCs.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from fedweigh.bench.cells import load_cell_scores
from fedweigh.bench.stats import dersimonian_laird, holm, paired_t_interval, wilcoxon_p
from fedweigh.methods import parse_method

__all__ = [
    "AgainstFedAvg",
    "against_fedavg",
    "BOOTSTRAP_SEED",
    "CONFIDENCE",
    "ENDPOINTS",
    "Effect",
    "LAST_K",
    "RARE_FRACTION",
    "N_RESAMPLES",
    "PLATEAU_TOL_AUC",
    "REFERENCE_METHOD",
    "bootstrap_aucs",
    "endpoint_scores",
    "finding_group_aucs",
    "indicator",
    "noise_floor",
    "paired_effect",
    "paired_noise_floor",
    "per_finding_auc",
    "plateau_reached",
    "rare_findings",
    "resample_counts",
    "seed_effects",
    "verdict",
    "weighted_macro_auc",
]

#: The method every effect is measured against.
REFERENCE_METHOD = "fedavg"
#: Bootstrap resamples per (scenario, seed), and the seed of their counts.
N_RESAMPLES, BOOTSTRAP_SEED = 1000, 0
#: Two-sided interval level.
CONFIDENCE = 0.95
#: Plateau tolerance in AUC when the run has no noise floor (a single seed).
PLATEAU_TOL_AUC = 0.005
#: Scored rounds (after round 0) the ``last_k`` endpoint averages; the endpoints' names.
LAST_K = 3
ENDPOINTS: tuple[str, ...] = ("final", "last_k")
#: Share of the findings counted rare (the lowest test prevalence), rounded up.
RARE_FRACTION = 0.25
#: Resamples scored at once (bounds the memory: chunk x test images floats).
_CHUNK = 100


def indicator(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Labels as an (N, C) float array: multi-label as is (NaN = unknown), class indices one-hot."""
    labels = np.asarray(labels)
    if labels.ndim == 1:
        return np.eye(num_classes, dtype=np.float64)[labels.astype(np.int64)]
    return labels.astype(np.float64)


def weighted_macro_auc(labels: np.ndarray, scores: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Macro AUC of ``scores`` (N, C) for each row of ``counts`` (B, N), shape (B,).

    AUC_j = sum_{pos p, neg n} w_p w_n ([s_p > s_n] + [s_p = s_n] / 2) / (W_pos W_neg) over the
    images with a known label j; a class without both labels in a row is left out of that row's mean
    (NaN when no class qualifies). With counts of ones this is ``roc_auc_score``'s macro AUC.

    Per class the negatives are sorted once; for every positive, ``searchsorted`` finds the negatives
    strictly below its score and those tied with it, so each row needs one cumulative sum of the
    negatives' counts: sum_p w_p (W_neg(< s_p) + W_neg(= s_p) / 2). With whole-number counts every sum
    is exact in float64, so the result does not depend on the order of the additions.
    """
    y = indicator(labels, scores.shape[1])
    counts = np.atleast_2d(np.asarray(counts, dtype=np.float64))
    per_class = np.full((counts.shape[0], y.shape[1]), np.nan)
    for j in range(y.shape[1]):
        pos, neg = np.flatnonzero(y[:, j] == 1), np.flatnonzero(y[:, j] == 0)  # NaN: unknown, in neither
        if pos.size == 0 or neg.size == 0:
            continue
        neg = neg[np.argsort(scores[neg, j], kind="stable")]
        below = np.searchsorted(scores[neg, j], scores[pos, j], side="left")  # negatives < s_p
        up_to = np.searchsorted(scores[neg, j], scores[pos, j], side="right")  # negatives <= s_p
        cum = np.zeros((counts.shape[0], neg.size + 1))
        np.cumsum(counts[:, neg], axis=1, out=cum[:, 1:])
        pos_w = counts[:, pos]
        pairs = (pos_w * (cum[:, below] + cum[:, up_to])).sum(axis=1) / 2.0
        pos_total, neg_total = pos_w.sum(axis=1), cum[:, -1]
        with np.errstate(divide="ignore", invalid="ignore"):
            per_class[:, j] = np.where(
                (pos_total > 0) & (neg_total > 0), pairs / (pos_total * neg_total), np.nan
            )
    with np.errstate(invalid="ignore"):
        valid = ~np.isnan(per_class)
        total = np.where(valid, per_class, 0.0).sum(axis=1)
        n = valid.sum(axis=1)
        return np.where(n > 0, total / np.maximum(n, 1), np.nan)


def resample_counts(n_images: int, n_resamples: int, rng: np.random.Generator) -> np.ndarray:
    """(B, N) bootstrap counts: how often each of N test images is drawn, N draws with replacement."""
    return rng.multinomial(n_images, np.full(n_images, 1.0 / n_images), size=n_resamples)


def bootstrap_aucs(
    scores: np.ndarray,
    labels: np.ndarray,
    seed: int,
    n_resamples: int = N_RESAMPLES,
    bootstrap_seed: int = BOOTSTRAP_SEED,
) -> tuple[float, np.ndarray]:
    """(AUC on the full test set, AUC on each of the seed's resamples (B,)).

    ``scores`` (S, N, C): S models (``local``: one per site) are averaged per resample. The counts
    depend on (``bootstrap_seed``, ``seed``) only, so every method of a seed gets the same resamples.
    """
    scores = np.asarray(scores, dtype=np.float64)
    scores = scores[None] if scores.ndim == 2 else scores
    n = scores.shape[1]
    full = float(np.mean([weighted_macro_auc(labels, s, np.ones((1, n)))[0] for s in scores]))
    rng = np.random.default_rng([bootstrap_seed, int(seed)])
    out = np.empty(n_resamples)
    for lo in range(0, n_resamples, _CHUNK):
        counts = resample_counts(n, min(_CHUNK, n_resamples - lo), rng)
        out[lo : lo + len(counts)] = np.mean([weighted_macro_auc(labels, s, counts) for s in scores], axis=0)
    return full, out


@dataclass(frozen=True)
class Effect:
    """A method's AUC minus FedAvg's: mean over seeds and its bootstrap interval."""

    mean: float
    ci_low: float
    ci_high: float

    def as_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "ci_low": self.ci_low, "ci_high": self.ci_high}


def paired_effect(
    method: Sequence[tuple[float, np.ndarray]],
    reference: Sequence[tuple[float, np.ndarray]],
    confidence: float = CONFIDENCE,
) -> Effect | None:
    """Effect from per-seed (full AUC, resampled AUCs) of a method and the reference on the same resamples.

    mean = mean_s (A_s - R_s); interval = percentiles of D^b = mean_s (A_s^b - R_s^b), resamples with
    an undefined D^b left out. None when no resample is defined.
    """
    if len(method) != len(reference) or not method:
        raise ValueError("paired_effect: one (method, reference) pair per seed is needed")
    diffs = np.stack([m[1] - r[1] for m, r in zip(method, reference, strict=True)])  # (seeds, B)
    per_resample = diffs.mean(axis=0)
    per_resample = per_resample[np.isfinite(per_resample)]
    point = np.mean([m[0] - r[0] for m, r in zip(method, reference, strict=True)])
    if per_resample.size == 0 or not np.isfinite(point):
        return None
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(per_resample, [tail, 100.0 - tail])
    return Effect(float(point), float(low), float(high))


def noise_floor(final_auc: Sequence[tuple[str, str, int, float]]) -> float | None:
    """Mean over (scenario, method) of the standard deviation across seeds (ddof 1) of the final test AUC.

    ``final_auc``: (scenario, method, seed, AUC) rows. None with fewer than two seeds per cell group.
    """
    groups: dict[tuple[str, str], list[float]] = {}
    for scenario, method, _, auc in final_auc:
        if np.isfinite(auc):
            groups.setdefault((scenario, method), []).append(float(auc))
    sds = [float(np.std(v, ddof=1)) for v in groups.values() if len(v) >= 2]
    return float(np.mean(sds)) if sds else None


def endpoint_scores(results: pd.DataFrame, endpoint: str, last_k: int = LAST_K) -> pd.Series:
    """Per (scenario, method, seed): the cell's test AUC at the ``endpoint`` (:data:`ENDPOINTS`).

    ``final``: the AUC of the cell's last round (NaN when that round was not scored); ``last_k``: the
    mean AUC of its last ``last_k`` scored rounds after round 0.
    """
    if endpoint not in ENDPOINTS:
        raise ValueError(f"unknown endpoint {endpoint!r}; known: {', '.join(ENDPOINTS)}")
    keys = ["scenario", "method", "seed"]
    if endpoint == "final":
        last = results["round"] == results.groupby(keys)["round"].transform("max")
        return results[last].set_index(keys)["auc"].astype(np.float64).sort_index()
    scored = results[(results["round"] > 0) & results["auc"].notna()].sort_values([*keys, "round"])
    return scored.groupby(keys)["auc"].apply(lambda a: float(a.tail(last_k).mean())).sort_index()


def _paired_differences(
    scores: pd.Series, method: str, reference: str, scenario: str
) -> tuple[list[int], np.ndarray]:
    """(seeds, endpoint_method - endpoint_reference per seed) over the seeds both have a finite score."""
    try:
        a = scores.xs((scenario, method), level=("scenario", "method"))
        b = scores.xs((scenario, reference), level=("scenario", "method"))
    except KeyError:
        return [], np.empty(0)
    d = (a - b).dropna()
    return [int(s) for s in d.index], d.to_numpy(dtype=np.float64)


def seed_effects(
    scores: pd.Series,
    methods: Sequence[str],
    scenarios: Sequence[str],
    reference: str = REFERENCE_METHOD,
    confidence: float = CONFIDENCE,
) -> dict[str, dict]:
    """Per method but ``reference``: ``scenarios`` (per scenario the paired t interval over seeds, as
    :meth:`fedweigh.bench.stats.Interval.as_dict`, None with < 2 seeds) and ``pooled`` (the
    DerSimonian-Laird estimate over the scenarios, v_i = SE_i^2; None when undefined; with one
    scenario its own t interval and p, since a z interval on its SE would ignore the t's few degrees
    of freedom).

    ``scores``: :func:`endpoint_scores`' series.
    """
    out: dict[str, dict] = {}
    for m in methods:
        if m == reference:
            continue
        per: dict[str, dict | None] = {}
        effects, variances = [], []
        for sc in scenarios:
            _, d = _paired_differences(scores, m, reference, sc)
            interval = paired_t_interval(d, confidence)
            per[sc] = None if interval is None else interval.as_dict()
            if interval is not None:
                effects.append(interval.mean)
                variances.append(interval.se**2)
        pooled = dersimonian_laird(effects, variances, confidence) if effects else None
        pooled_dict = None if pooled is None else pooled.as_dict()
        if pooled is not None and pooled.k == 1:
            # one scenario: nothing to pool; its own t interval over seeds, not a z interval on its SE
            (only,) = [e for e in per.values() if e is not None]
            pooled_dict.update(mean=only["mean"], ci_low=only["ci_low"], ci_high=only["ci_high"], p=only["p"])
        out[m] = {"scenarios": per, "pooled": pooled_dict}
    return out


def verdict(low: float | None, high: float | None) -> str:
    """``better`` when the interval lies above 0, ``worse`` below, ``no evidence`` when it holds 0 or
    is undefined."""
    if low is None or high is None or not (np.isfinite(low) and np.isfinite(high)):
        return "no evidence"
    return "better" if low > 0 else "worse" if high < 0 else "no evidence"


def paired_noise_floor(
    scores: pd.Series, methods: Sequence[str], scenarios: Sequence[str], reference: str = REFERENCE_METHOD
) -> dict[str, float | None]:
    """Per method but ``reference``: the mean over scenarios of the seed standard deviation (ddof 1)
    of the paired difference to ``reference``; None without a scenario of >= 2 paired seeds."""
    floor: dict[str, float | None] = {}
    for m in methods:
        if m == reference:
            continue
        sds = []
        for sc in scenarios:
            _, d = _paired_differences(scores, m, reference, sc)
            if d.size >= 2:
                sds.append(float(np.std(d, ddof=1)))
        floor[m] = float(np.mean(sds)) if sds else None
    return floor


def per_finding_auc(labels: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """(C,) AUC of each finding (NaN where the test labels lack positives or negatives), by
    :func:`weighted_macro_auc` on that finding's column alone."""
    y = indicator(labels, scores.shape[1])
    ones = np.ones((1, len(y)))
    return np.array([weighted_macro_auc(y[:, [j]], scores[:, [j]], ones)[0] for j in range(y.shape[1])])


def rare_findings(labels: np.ndarray, fraction: float = RARE_FRACTION) -> list[int]:
    """Indices of the ceil(C x ``fraction``) findings with the lowest prevalence among the known test
    labels (ties: the first listed)."""
    y = np.asarray(labels, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        prevalence = np.nanmean(y, axis=0)
    n_rare = int(np.ceil(y.shape[1] * fraction))
    return sorted(int(j) for j in np.argsort(prevalence, kind="stable")[:n_rare])


def finding_group_aucs(labels: np.ndarray, scores: np.ndarray) -> tuple[float, float] | None:
    """(common-finding AUC, rare-finding AUC) of a multi-label test set (:func:`rare_findings`); each
    the mean AUC of its findings, ``scores`` (S, N, C) averaged over the S models; None for
    multi-class labels or fewer than two findings."""
    labels = np.asarray(labels)
    if labels.ndim != 2 or labels.shape[1] < 2:
        return None
    scores = np.asarray(scores, dtype=np.float64)
    scores = scores[None] if scores.ndim == 2 else scores
    rare = rare_findings(labels)
    common = [j for j in range(labels.shape[1]) if j not in rare]
    per = np.mean([per_finding_auc(labels, s) for s in scores], axis=0)

    def mean_defined(values: np.ndarray) -> float:  # a finding without both labels has no AUC
        values = values[np.isfinite(values)]
        return float(values.mean()) if values.size else float("nan")

    return mean_defined(per[common]), mean_defined(per[rare])


def plateau_reached(curve: Sequence[tuple[int, float]], rounds: int, tol: float) -> bool | None:
    """Whether AUC(T) - AUC(t0) < ``tol``, t0 the last scored round <= floor(2T / 3); None when t0 = 0.

    ``curve``: (round, test AUC) of the scored rounds, the last at round T = ``rounds``.
    """
    scored = {int(t): float(a) for t, a in curve if a is not None and np.isfinite(a)}
    if rounds not in scored:
        return None
    earlier = [t for t in scored if t <= (2 * rounds) // 3]
    t0 = max(earlier, default=0)
    if t0 == 0:
        return None
    return bool(scored[rounds] - scored[t0] < tol)


@dataclass
class AgainstFedAvg:
    """The effects against FedAvg of a run and what is undefined in it (``notes``: key -> why)."""

    effects: dict[str, dict[str, Effect | None]] | None
    wilcoxon_holm_p: dict[str, float | None] | None
    noise_floor: float | None
    plateau: dict[str, float | None]
    plateau_tol: float
    gm_05: dict[tuple[str, str, int], float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    finding_groups: dict[tuple[str, str, int], tuple[float, float]] = field(default_factory=dict)


def _cell_statistics(
    cells_dir: Path, key: str, seed: int, n_resamples: int, bootstrap_seed: int, bootstrap: bool
) -> tuple[np.ndarray, float, tuple[float, np.ndarray] | None, tuple[float, float] | None] | None:
    """(test labels, GM at 0.5, :func:`bootstrap_aucs` or None, :func:`finding_group_aucs`) of a stored
    cell; None if it has no stored predictions."""
    from fedweigh.metrics import geometric_mean

    loaded = load_cell_scores(cells_dir, key)
    if loaded is None:
        return None
    scores, labels = loaded
    gm = float(np.mean([geometric_mean(labels, s, 0.5)[0] for s in scores]))
    return (
        labels,
        gm,
        bootstrap_aucs(scores, labels, seed, n_resamples, bootstrap_seed) if bootstrap else None,
        finding_group_aucs(labels, scores),
    )


def _final_auc(record: dict) -> float:
    rows = [r for r in record["rows"] if r.get("test_auc") is not None]
    return float(rows[-1]["test_auc"]) if rows and rows[-1]["round"] == record["rounds"] else float("nan")


def _plateau_fractions(methods: Sequence[str], by_cell: dict, tol: float) -> dict[str, float | None]:
    """Per method: the fraction of its cells whose test AUC reached its plateau (:func:`plateau_reached`
    with tolerance ``tol``); None when no cell of the method has the rounds to tell."""
    plateau: dict[str, float | None] = {}
    for m in methods:
        reached = [
            plateau_reached(
                [(r["round"], r.get("test_auc")) for r in rec["rows"] if r.get("test_auc") is not None],
                int(rec["rounds"]),
                tol,
            )
            for (_, method, _), rec in by_cell.items()
            if method == m
        ]
        defined = [x for x in reached if x is not None]
        plateau[m] = float(np.mean(defined)) if defined else None
    return plateau


def _score_cells(
    by_cell: dict, cells_dir: Path, n_resamples: int, bootstrap_seed: int, with_bootstrap: bool, jobs: int
) -> tuple[dict, dict, dict]:
    """(GM at 0.5 per cell, bootstrap of the test AUC per cell, (common, rare) finding AUC per cell)
    from the stored test predictions, in
    ``jobs`` processes; ValueError when two methods' cells of one scenario and seed have different
    test labels."""
    gm_05: dict[tuple[str, str, int], float] = {}
    cached: dict[tuple[str, str, int], tuple[float, np.ndarray]] = {}
    groups: dict[tuple[str, str, int], tuple[float, float]] = {}
    test_labels: dict[tuple[str, int], np.ndarray] = {}
    keys = list(by_cell)
    tasks = [(cells_dir, by_cell[k]["key"], k[2], n_resamples, bootstrap_seed, with_bootstrap) for k in keys]
    if jobs > 1 and len(tasks) > 1:  # cells are independent: score them in parallel (numpy only)
        with ProcessPoolExecutor(
            max_workers=min(jobs, len(tasks)), mp_context=mp.get_context("spawn")
        ) as pool:
            scored = list(pool.map(_cell_statistics, *zip(*tasks, strict=True), chunksize=4))
    else:
        scored = [_cell_statistics(*t) for t in tasks]
    for key, result in zip(keys, scored, strict=True):
        if result is None:
            continue
        labels, gm_05[key], boot, group = result
        shared = test_labels.setdefault((key[0], key[2]), labels)
        if not np.array_equal(shared, labels, equal_nan=True):
            raise ValueError(
                f"cell {by_cell[key]['key']}: its test labels differ from another method's of the same seed"
            )
        if boot is not None:
            cached[key] = boot
        if group is not None:
            groups[key] = group
    return gm_05, cached, groups


def _effects(
    methods: Sequence[str], scenarios: Sequence[str], seeds: Sequence[int], cached: dict
) -> dict[str, dict[str, Effect | None]]:
    """Per method but FedAvg and per scenario: the paired effect over the seeds both have scored."""
    effects: dict[str, dict[str, Effect | None]] = {}
    for m in methods:
        if m == REFERENCE_METHOD:
            continue
        effects[m] = {}
        for sc in scenarios:
            pairs = [(cached.get((sc, m, int(s))), cached.get((sc, REFERENCE_METHOD, int(s)))) for s in seeds]
            pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
            effects[m][sc] = paired_effect([a for a, _ in pairs], [b for _, b in pairs]) if pairs else None
    return effects


def against_fedavg(
    methods: Sequence[str],
    scenarios: Sequence[str],
    seeds: Sequence[int],
    records: Sequence[dict],
    cells_dir: Path,
    n_resamples: int = N_RESAMPLES,
    bootstrap_seed: int = BOOTSTRAP_SEED,
    jobs: int = 1,
) -> AgainstFedAvg:
    """Effects with intervals, Wilcoxon-Holm p, noise floor, plateau fractions and GM at 0.5 of a run.

    Effects cover every method but FedAvg (references included); the Wilcoxon test and Holm's
    correction cover the federated ones. GM at 0.5 (``gm_05``, per cell) is recomputed from the stored
    test predictions (``local``: the mean over its site models; multi-class: the arg-max). ``jobs``
    processes score the cells in parallel; the numbers do not depend on it.
    """
    by_cell = {(r["scenario"], r["method"], int(r["seed"])): r for r in records}
    notes: dict[str, str] = {}
    floor = noise_floor([(sc, m, s, _final_auc(r)) for (sc, m, s), r in by_cell.items()])
    if floor is None:
        notes["noise_floor_auc"] = "needs at least two seeds"
    tol = floor if floor is not None else PLATEAU_TOL_AUC
    plateau = _plateau_fractions(methods, by_cell, tol)
    if any(v is None for v in plateau.values()):
        notes["plateau_reached"] = (
            "null for a method none of whose cells has a scored round after round 0 and at or before 2T/3"
        )
    with_bootstrap = REFERENCE_METHOD in methods
    gm_05, cached, groups = _score_cells(
        by_cell, cells_dir, n_resamples, bootstrap_seed, with_bootstrap, jobs
    )
    if not groups:
        notes["mean_auc_common"] = notes["mean_auc_rare"] = (
            "common and rare findings are defined for multi-label test sets with stored predictions"
        )
    if not with_bootstrap:
        notes["effect_vs_fedavg"] = notes["wilcoxon_holm_p_auc"] = "FedAvg is not among the run's methods"
        return AgainstFedAvg(None, None, floor, plateau, tol, gm_05, notes, groups)
    effects = _effects(methods, scenarios, seeds, cached)
    raw = {
        m: wilcoxon_p([e.mean if e is not None else np.nan for e in effects[m].values()])
        for m in effects
        if parse_method(m).kind == "federated"
    }
    if any(p is None for p in raw.values()):
        notes["wilcoxon_holm_p_auc"] = (
            "null for a method whose per-scenario effects are all zero or undefined"
        )
    return AgainstFedAvg(effects, holm(raw), floor, plateau, tol, gm_05, notes, groups)
