"""The critical-difference diagram: the CD interval and its label clear the rank axis' tick labels."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import scikit_posthocs as sp  # noqa: E402

from fedweigh.bench.plots import lift_cd_bar, plot_cd_diagram  # noqa: E402
from fedweigh.bench.stats import compare  # noqa: E402


@pytest.mark.parametrize("methods", [3, 5, 9])
def test_cd_bar_and_label_sit_above_the_tick_labels(tmp_path, methods):
    rng = np.random.default_rng(methods)
    table = pd.DataFrame(rng.random((6, methods)), columns=[f"method-{i}" for i in range(methods)])
    comparison = compare(table)
    assert plot_cd_diagram(comparison, tmp_path / "cd.png", "test AUC").is_file()

    fig, ax = plt.subplots(figsize=(8, 1.6 + 0.25 * methods))
    sp.critical_difference_diagram(comparison.ranks, comparison.pvalues, cd=comparison.cd, ax=ax)
    lift_cd_bar(ax)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ticks_top = max(t.get_window_extent(renderer).y1 for t in ax.get_xticklabels() if t.get_text())
    (bar,) = [line for line in ax.lines if len(line.get_ydata()) == 2 and min(line.get_ydata()) > 0]
    bar_y = ax.transData.transform((0, bar.get_ydata()[0]))[1]
    (label,) = [t for t in ax.texts if t.get_text().startswith("CD")]
    label_box = label.get_window_extent(renderer)
    axes_top = ax.get_window_extent(renderer).y1
    plt.close(fig)
    assert bar_y > ticks_top
    assert label_box.y0 > bar_y and label_box.y1 <= axes_top + 1
