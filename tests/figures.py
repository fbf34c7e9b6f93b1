"""Read back what a figure shows: the tests check the plotted data, not only that a PNG was written."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np


@contextlib.contextmanager
def captured_figures() -> Iterator[dict[Path, object]]:
    """Every matplotlib figure saved inside the block, by the path it was saved to (still written)."""
    from matplotlib.figure import Figure

    saved: dict[Path, object] = {}
    original = Figure.savefig

    def savefig(self, fname, *args, **kwargs):
        saved[Path(fname)] = self
        return original(self, fname, *args, **kwargs)

    Figure.savefig = savefig
    try:
        yield saved
    finally:
        Figure.savefig = original


def stacked_bands(ax, rounds) -> tuple[list[str], np.ndarray]:
    """(labels, tops) of a stackplot: tops[i, j] is the upper edge of band i at rounds[j]."""
    from matplotlib.collections import PolyCollection

    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    tops = np.zeros((len(bands), len(rounds)))
    for i, band in enumerate(bands):
        vertices = np.concatenate([p.vertices for p in band.get_paths()])
        for j, x in enumerate(rounds):
            tops[i, j] = vertices[np.isclose(vertices[:, 0], x), 1].max()
    return [b.get_label() for b in bands], tops


def assert_weights_plot(fig, rows: list[dict]) -> None:
    """The stacked area of ``fig`` shows each round's weights, one band per site in natural order."""
    from fedweigh.plots import _site_key

    (ax, *_) = fig.axes
    rounds = [r["round"] for r in rows]
    sites = sorted({s for r in rows for s in r["weights"]}, key=_site_key)
    labels, tops = stacked_bands(ax, rounds)
    assert labels == sites
    expected = np.cumsum([[r["weights"].get(s, 0.0) for r in rows] for s in sites], axis=0)
    np.testing.assert_allclose(tops, expected, rtol=0, atol=1e-9)


def lines(ax) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """label -> (x, y) of the labelled lines of an axis."""
    return {
        line.get_label(): (np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float))
        for line in ax.get_lines()
        if not line.get_label().startswith("_")
    }


def effect_points(fig) -> dict[str, dict[str, tuple[float, float, float, bool]]]:
    """scenario (panel title) -> method (y tick label) -> (mean, ci_low, ci_high, filled) of a forest
    plot drawn with ``errorbar``; ``filled``: the marker is filled (the effect counts)."""
    from matplotlib.colors import to_rgba

    shown: dict[str, dict[str, tuple[float, float, float, bool]]] = {}
    for ax in fig.axes:
        if not ax.get_visible() or not ax.containers:
            continue
        names = {
            round(float(t), 6): lab.get_text()
            for t, lab in zip(ax.get_yticks(), ax.get_yticklabels(), strict=True)
        }
        panel = shown.setdefault(ax.get_title(), {})
        for container in ax.containers:
            marker, _, (bars, *_) = container.lines
            x, y = float(marker.get_xdata()[0]), float(marker.get_ydata()[0])
            ((low, _), (high, _)) = bars.get_segments()[0]
            filled = to_rgba(marker.get_markerfacecolor()) != to_rgba("white")
            panel[names[round(y, 6)]] = (x, float(low), float(high), filled)
    return shown


def noise_band(ax) -> tuple[float, float] | None:
    """(low, high) x-extent of the grey noise-floor band of a forest-plot panel, None without one."""
    from matplotlib.patches import Polygon, Rectangle

    for patch in ax.patches:
        if isinstance(patch, Rectangle | Polygon) and patch.get_label().startswith("noise floor"):
            xs = patch.get_path().transformed(patch.get_patch_transform()).vertices[:, 0]
            return float(xs.min()), float(xs.max())
    return None
