"""Plots people would rather look at than read: client weights over rounds, metrics by round."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from fedweigh.io import write_figure


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def site_colours(n: int) -> list:
    """``n`` distinct colours: tab10 up to 10 sites, tab20 up to 20, a continuous map beyond."""
    plt = _pyplot()
    if n <= 10:
        return [plt.get_cmap("tab10")(i) for i in range(n)]
    if n <= 20:
        return [plt.get_cmap("tab20")(i) for i in range(n)]
    return list(plt.get_cmap("viridis")(np.linspace(0.0, 1.0, n)))


def plot_client_weights(
    rounds: Sequence[int],
    weights: Sequence[Mapping[str, float]],
    path: str | Path,
    title: str = "",
    reference: Mapping[str, float] | None = None,
    skipped: Sequence[int] = (),
) -> Path:
    """Stacked steps of each site's aggregation weight per round (one band, one colour per site; a
    round's weights hold across its whole width, as the round used them).

    ``skipped``: rounds that did not aggregate (the global model was kept); they are shaded and
    labelled, and the bands are not drawn through them (no interpolation across a skipped round).

    Sites absent from a round (partial participation) contribute 0 there. Weights that do not sum to
    one (FedNova acts on deltas with an effective step) are drawn as given. ``reference`` (e.g. the
    sites' N_k / N) is drawn as dashed band edges, the weights plain FedAvg would give. Rounds are
    whole numbers on the axis.
    """
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    sites = sorted({s for w in weights for s in w} | set(reference or {}), key=_site_key)
    matrix = np.array([[float(w.get(s, 0.0)) for w in weights] for s in sites])
    colours = site_colours(len(sites))
    fig, ax = plt.subplots(figsize=(7, 4))
    for first, (x, block) in enumerate(_segments(list(rounds), matrix, set(skipped))):
        labelled = {} if len(sites) > 20 or first else {"labels": sites}
        ax.stackplot(x, block, colors=colours, **labelled)
    for i, r in enumerate(sorted(set(skipped))):
        ax.axvspan(
            r - 0.4,
            r + 0.4,
            color="0.85",
            hatch="//",
            zorder=0,
            label="no aggregation (model kept)" if i == 0 else None,
        )
    if reference:
        edges = np.cumsum([float(reference.get(s, 0.0)) for s in sites])
        for i, edge in enumerate(edges[:-1]):
            ax.axhline(
                edge, color="black", linestyle="--", linewidth=0.9, label="N_k / N" if i == 0 else None
            )
    if len(sites) <= 20 or reference:
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("aggregation weight")
    every = [*rounds, *skipped]
    if every:
        ax.set_xlim(min(every) - 0.5, max(every) + 0.5)
    ax.set_title(title or "client weights by round")
    fig.tight_layout()
    out = write_figure(path, fig, dpi=110)
    plt.close(fig)
    return out


def _segments(
    rounds: list[int], matrix: np.ndarray, skipped: set[int]
) -> list[tuple[list[float], np.ndarray]]:
    """Runs of aggregated rounds not broken by a skipped round, drawn as steps: round r's weights hold
    from r - 0.5 to r + 0.5 (a weight is what one round used, not a ramp between rounds), so each round's
    value appears three times (at r - 0.5, r and r + 0.5) and the band jumps at the half-rounds."""
    runs: list[list[int]] = []
    for i, r in enumerate(rounds):
        if runs and not any(rounds[runs[-1][-1]] < s < r for s in skipped):
            runs[-1].append(i)
        else:
            runs.append([i])
    out = []
    for run in runs:
        x = [edge for i in run for edge in (rounds[i] - 0.5, rounds[i], rounds[i] + 0.5)]
        out.append(([float(v) for v in x], np.repeat(matrix[:, run], 3, axis=1)))
    return out


def plot_metric_by_round(
    rounds: Sequence[int],
    series: Mapping[str, Sequence[float]],
    path: str | Path,
    ylabel: str,
    title: str = "",
    points: Mapping[str, tuple[int, float]] | None = None,
) -> Path:
    """One line per series (e.g. test AUC, test GM) against the round; ``points``: single labelled
    values (e.g. the final model's GM at other thresholds), drawn as stars."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    from matplotlib.ticker import MaxNLocator

    for name, values in series.items():
        ax.plot(rounds, values, marker="o", label=name)
    for name, (x, y) in (points or {}).items():
        ax.plot([x], [y], marker="*", markersize=14, linestyle="none", label=name)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    out = write_figure(path, fig, dpi=110)
    plt.close(fig)
    return out


def _site_key(name: str):
    """Natural sort: site-2 before site-10."""
    head, _, tail = name.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (name, 0)
