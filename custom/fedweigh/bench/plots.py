"""The benchmark's figures (PNG, matplotlib Agg): critical-difference diagrams, AUC by round, effects
against FedAvg, client weights, ROC curves, decision curves and multi-class confusion matrices."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from fedweigh.bench.stats import Comparison
from fedweigh.io import write_figure


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    fig.tight_layout()
    out = write_figure(path, fig, dpi=110)
    _pyplot().close(fig)
    return out


def plot_cd_diagram(comparison: Comparison, path: str | Path, title: str) -> Path:
    """Critical-difference diagram (scikit-posthocs): methods on the average-rank axis, bars joining
    methods whose Nemenyi p-value is >= 0.05, and the CD interval."""
    import scikit_posthocs as sp

    if comparison.pvalues is None:
        raise ValueError(f"{title}: no Nemenyi p-values ({comparison.note})")
    plt = _pyplot()
    k = len(comparison.ranks)
    fig, ax = plt.subplots(figsize=(8, 1.6 + 0.25 * k))
    sp.critical_difference_diagram(comparison.ranks, comparison.pvalues, cd=comparison.cd, ax=ax)
    lift_cd_bar(ax)
    ax.set_title(title)
    return _save(fig, path)


def lift_cd_bar(ax) -> None:
    """Move the CD interval and its label above the rank axis' tick labels, which the library draws
    them across; the axes grow upwards to make room."""
    fig = ax.figure
    bar = [line for line in ax.lines if len(line.get_ydata()) == 2 and min(line.get_ydata()) > 0]
    text = [t for t in ax.texts if t.get_text().startswith("CD")]
    if not bar:
        return
    points = fig.dpi / 72.0
    for _ in range(4):  # the data scale changes with the limits: settle in a few passes
        renderer = fig.canvas.get_renderer()
        labels = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
        if not labels:
            return
        top = max(b.y1 for b in labels)  # display coordinates

        def data_y(display_y: float) -> float:
            return float(ax.transData.inverted().transform((0.0, display_y))[1])

        y_bar = data_y(top + 4 * points)
        for line in bar:
            line.set_ydata([y_bar, y_bar])
        needed = y_bar
        for t in text:
            t.set_verticalalignment("bottom")
            t.set_position((t.get_position()[0], data_y(top + 6 * points)))
            needed = data_y(t.get_window_extent(renderer).y1 + 2 * points)
        low, high = ax.get_ylim()
        if needed <= high:
            return
        ax.set_ylim(low, needed + 0.05 * (needed - low))


def plot_metric_curves(
    curves: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    path: str | Path,
    xlabel: str,
    ylabel: str,
    title: str,
    dashed: Sequence[str] = (),
    integer_x: bool = False,
) -> Path:
    """One line per method, ``curves[method] = (x, y)``; methods in ``dashed`` (references) dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, (x, y) in curves.items():
        ax.plot(
            x, y, linestyle="--" if name in dashed else "-", marker="o" if len(x) <= 12 else None, label=name
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if integer_x:
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    return _save(fig, path)


def plot_auc_by_round(
    results: pd.DataFrame, scenario: str, path: str | Path, references: Sequence[str]
) -> Path:
    """Test AUC of the global model by round for every method of ``scenario`` (mean over seeds)."""
    sub = results[results["scenario"] == scenario]
    mean = sub.groupby(["method", "round"], sort=False)["auc"].mean()
    curves = {}
    for method in dict.fromkeys(sub["method"]):
        series = mean.loc[method].dropna()  # the local reference is scored at rounds 0 and T only
        curves[method] = (list(series.index), list(series.values))
    return plot_metric_curves(
        curves, path, "round", "test macro AUC", f"{scenario}: AUC by round", references, integer_x=True
    )


#: ``gid`` of the image-only intervals a forest plot draws beside the seed-paired ones
IMAGE_ONLY_GID = "image-only interval"


def _seed_effect(summary: Mapping, method: str, scenario: str | None, endpoint: str) -> dict | None:
    """The seed-paired interval of ``method`` on ``scenario`` (None: the pooled random-effects
    estimate) from ``summary["effect_vs_fedavg_seeds"][endpoint]``; None where the summary has none."""
    seeds = (summary.get("effect_vs_fedavg_seeds") or {}).get(endpoint) or {}
    entry = seeds.get(method)
    if not entry:
        return None
    return entry.get("pooled") if scenario is None else (entry.get("scenarios") or {}).get(scenario)


def plot_effects(summary: Mapping, path: str | Path, title: str, endpoint: str = "last_k") -> Path:
    """Forest plot of the effects against FedAvg on test AUC: one panel per scenario, one row per method.

    With seed-paired intervals in the summary (``effect_vs_fedavg_seeds[endpoint]``, training noise
    included) each row is that effect with its paired t interval over seeds; filled markers: the
    interval excludes 0 (the verdict's rule). The image-only bootstrap interval of ``effect_vs_fedavg``
    (test-set sampling only) is drawn beside it as a thin grey line; a last panel holds the pooled
    random-effects estimate over the scenarios. Without seed-paired intervals (one seed) the rows are
    the image-only effects with their 95% bootstrap intervals, the grey band is the seed noise floor
    (+-``noise_floor_auc``) and filled markers need the interval to exclude 0 and |effect| to exceed
    the floor. The line at 0 is FedAvg."""
    effects = summary.get("effect_vs_fedavg")
    if not effects:
        raise ValueError(f"{title}: summary has no effects against FedAvg")
    scenarios = list(summary["scenarios"])
    seeded = any(
        _seed_effect(summary, m, sc, endpoint) is not None for m in effects for sc in [*scenarios, None]
    )
    methods = [m for m in effects if any(effects[m].get(sc) for sc in scenarios)]
    if not methods:
        raise ValueError(f"{title}: every effect against FedAvg is empty")
    floor = None if seeded else summary.get("noise_floor_auc")
    panels: list[str | None] = [*scenarios, None] if seeded else list(scenarios)
    plt = _pyplot()
    cols = min(len(panels), 2)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(5.2 * cols, 0.7 + 0.32 * len(methods) * rows + 0.6 * rows), squeeze=False
    )
    y = np.arange(len(methods))[::-1]
    for ax, scenario in zip(axes.flat, panels, strict=False):
        if floor:
            ax.axvspan(-floor, floor, color="0.85", zorder=0, label=f"noise floor (+-{floor:.4f})")
        ax.axvline(0.0, color="0.3", linewidth=0.8, zorder=1)
        for yi, method in zip(y, methods, strict=True):
            image = effects[method].get(scenario) if scenario is not None else None
            e = _seed_effect(summary, method, scenario, endpoint) if seeded else image
            if e is None:
                continue
            mean, low, high = e["mean"], e["ci_low"], e["ci_high"]
            if seeded:
                counts = low > 0 or high < 0
                if image is not None:
                    ax.hlines(
                        yi - 0.22,
                        image["ci_low"],
                        image["ci_high"],
                        color="0.6",
                        linewidth=1.2,
                        zorder=1,
                        gid=IMAGE_ONLY_GID,
                    )
            else:
                counts = (low > 0 or high < 0) and (floor is None or abs(mean) > floor)
            color = "tab:green" if counts and mean > 0 else "tab:red" if counts else "tab:gray"
            ax.errorbar(
                mean,
                yi,
                xerr=[[mean - low], [high - mean]],
                fmt="o",
                color=color,
                mfc=color if counts else "white",
                capsize=3,
                zorder=2,
            )
        ax.set_yticks(y, methods)
        ax.set_title("pooled (random effects)" if scenario is None else scenario, fontsize=10)
        ax.set_xlabel(
            "test AUC - FedAvg (95% CI over seeds; grey: test images only)"
            if seeded
            else "test AUC - FedAvg (95% CI)"
        )
        ax.grid(axis="x", alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    return _save(fig, path)


def plot_roc(
    curves: Mapping[str, tuple[np.ndarray, np.ndarray]],
    path: str | Path,
    title: str,
    auc: Mapping[str, float],
) -> Path:
    """Macro ROC curves of the final models, one per method, with the chance diagonal."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for name, (fpr, tpr) in curves.items():
        ax.plot(fpr, tpr, label=f"{name} (AUC {auc.get(name, float('nan')):.3f})")
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("false-positive rate")
    ax.set_ylabel("true-positive rate (macro)")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)


def plot_decision_curves(
    thresholds: np.ndarray,
    curves: Mapping[str, np.ndarray],
    treat_all: np.ndarray,
    path: str | Path,
    title: str,
) -> Path:
    """Net benefit against threshold probability per method, with treat-all and treat-none."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, nb in curves.items():
        ax.plot(thresholds, nb, label=name)
    ax.plot(thresholds, treat_all, color="black", linestyle="--", linewidth=1, label="treat all")
    ax.axhline(0.0, color="grey", linestyle=":", linewidth=1, label="treat none")
    finite = np.concatenate([np.asarray(v)[np.isfinite(v)] for v in curves.values()] + [np.zeros(1)])
    top = max(0.05, float(np.nanmax(finite)) * 1.1 + 0.01)
    # as decision curves are read (Vickers & Elkin 2006): down to a tenth of the top below zero, where a
    # model is worse than treating no one; lower net benefits are clipped at the axis, not scaled to
    ax.set_ylim(max(min(-0.01, float(np.nanmin(finite)) - 0.01), -0.1 * top), top)
    ax.set_xlabel("threshold probability")
    ax.set_ylabel("net benefit (macro)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    return _save(fig, path)


def plot_confusion_matrices(
    matrices: Mapping[str, np.ndarray], class_names: Sequence[str], path: str | Path, title: str
) -> Path:
    """Row-normalised confusion matrices (true class x predicted class), one panel per method."""
    plt = _pyplot()
    names = list(matrices)
    cols = min(4, len(names))
    rows = int(np.ceil(len(names) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.ravel()[len(names) :]:
        ax.axis("off")
    for ax, name in zip(axes.ravel(), names, strict=False):
        m = np.asarray(matrices[name], dtype=np.float64)
        norm = m / np.maximum(m.sum(axis=1, keepdims=True), 1.0)
        ax.imshow(norm, vmin=0.0, vmax=1.0, cmap="Blues")
        ax.set_title(name, fontsize=9)
        ticks = np.arange(len(class_names))
        ax.set_xticks(ticks, class_names, fontsize=6)
        ax.set_yticks(ticks, class_names, fontsize=6)
        ax.set_xlabel("predicted", fontsize=7)
        ax.set_ylabel("true", fontsize=7)
    fig.suptitle(title)
    return _save(fig, path)
