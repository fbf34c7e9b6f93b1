import csv
import json

import numpy as np
from figures import assert_weights_plot, captured_figures, lines

from fedweigh.server.records import RoundRecorder, load_rows


def test_recorder_writes_json_csv_and_plots(tmp_path):
    rec = RoundRecorder(tmp_path, "feddraw")
    rec.set_metrics(0, {"test_auc": 0.5, "test_gm": 0.1})
    rec.set_round(1, {"site-1": 0.7, "site-2": 0.3}, {"lambda": 0.0, "beta": 1.0})
    rec.set_metrics(1, {"test_auc": 0.6, "test_gm": 0.2})
    rec.set_round(2, {"site-1": 0.4, "site-10": 0.6}, {"lambda": 1.0, "beta": 0.0})
    rec.set_metrics(2, {"test_auc": 0.7, "test_gm": 0.3})
    rec.flush()
    with captured_figures() as figures:
        paths = rec.plot()
    rec.close()
    rows = load_rows(tmp_path / "fedweigh_metrics.json")
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert rows[2]["weights"] == {"site-1": 0.4, "site-10": 0.6} and rows[1]["lambda"] == 0.0
    with open(tmp_path / "fedweigh_metrics.csv") as f:
        table = list(csv.DictReader(f))
    assert table[1]["weight/site-2"] == "0.3" and table[2]["weight/site-2"] == ""
    assert {p.name for p in paths} == {"fedweigh_client_weights.png", "fedweigh_auc_by_round.png"}
    assert all(p.stat().st_size > 1000 for p in paths)
    assert list((tmp_path / "tb_events" / "global").iterdir())
    assert json.loads((tmp_path / "fedweigh_metrics.json").read_text())["scheme"] == "feddraw"
    # the plots show the rows: weights as a stacked area (site-10 after site-2), AUC and GM by round
    assert_weights_plot(figures[tmp_path / "fedweigh_client_weights.png"], rows[1:])
    shown = lines(figures[tmp_path / "fedweigh_auc_by_round.png"].axes[0])
    # GM needs a threshold: the plot says which (0.5, the sites' default)
    assert set(shown) == {"test AUC", "test GM at threshold 0.5"}
    for label, key in (("test AUC", "test_auc"), ("test GM at threshold 0.5", "test_gm")):
        np.testing.assert_array_equal(shown[label][0], [0, 1, 2])
        np.testing.assert_array_equal(shown[label][1], [r[key] for r in rows])
