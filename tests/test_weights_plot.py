"""The client-weights plot: whole-number rounds, one colour per site beyond 10 sites, N_k / N reference."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from fedweigh.plots import plot_client_weights, site_colours  # noqa: E402


@pytest.fixture
def kept_figures(monkeypatch):
    """The figures the plot functions close (kept open for inspection, closed after the test)."""
    close = plt.close
    figures = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    yield figures
    for fig in figures:
        close(fig)


@pytest.mark.parametrize("n", [1, 4, 10, 11, 12, 20, 25])
def test_every_site_gets_its_own_colour(n):
    colours = [tuple(np.round(c, 6)) for c in site_colours(n)]
    assert len(colours) == n and len(set(colours)) == n


def test_rounds_are_whole_numbers_and_the_reference_is_drawn(tmp_path, kept_figures):
    sites = [f"site-{i}" for i in range(1, 13)]
    weights = [{s: (i + r) / sum(range(r, r + 12)) for i, s in enumerate(sites)} for r in range(1, 4)]
    sizes = {s: (i + 1) / 78 for i, s in enumerate(sites)}
    path = plot_client_weights([1, 2, 3], weights, tmp_path / "w.png", reference=sizes)
    assert path.is_file() and path.stat().st_size > 0
    (fig,) = kept_figures
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo - 1e-9 <= t <= hi + 1e-9]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    bands = [c.get_facecolor()[0][:3] for c in ax.collections]
    assert len({tuple(np.round(b, 6)) for b in bands}) == 12
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "N_k / N" in labels and "site-12" in labels
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(dashed) == 11
    assert dashed[0].get_ydata()[0] == pytest.approx(sizes["site-1"])


def test_weights_are_drawn_as_steps_one_flat_value_per_round(tmp_path, kept_figures):
    """A round's weight holds across the round (r - 0.5 .. r + 0.5) and jumps at the half-rounds: no ramp
    between two rounds' values."""
    weights = [{"site-1": 0.2, "site-2": 0.8}, {"site-1": 0.6, "site-2": 0.4}, {"site-1": 0.5, "site-2": 0.5}]
    plot_client_weights([1, 2, 3], weights, tmp_path / "w.png")
    (fig,) = kept_figures
    ax = fig.axes[0]
    first = ax.collections[0].get_paths()[0].vertices  # site-1's band, from 0 up to its weight
    top = sorted({(round(float(x), 6), round(float(y), 6)) for x, y in first if y > 0})
    assert top == [
        (0.5, 0.2),
        (1.0, 0.2),
        (1.5, 0.2),
        (1.5, 0.6),
        (2.0, 0.6),
        (2.5, 0.5),
        (2.5, 0.6),
        (3.0, 0.5),
        (3.5, 0.5),
    ]
    assert ax.get_xlim() == pytest.approx((0.5, 3.5))
