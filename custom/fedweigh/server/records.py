"""Per-round records of a fedweigh run: one row per round, and (given a folder) JSON, CSV, TensorBoard
events and plots.

The NVFlare controller and the benchmark both record a round's :class:`~fedweigh.server.rounds.RoundOutcome`
with :meth:`RoundRecorder.add_outcome`, so their rows have one format. Every number of a row is also
handed, as a scalar ``(tag, value, step)``, to the recorder's sinks and (``tensorboard=True``) its own
TensorBoard writer: the tags are :func:`metric_tag` (``global/val_auc``), :func:`weight_tag`
(``weight/site-1``, as the CSV column) and :func:`value_tag` (``scheme/lambda``), the step is the
row's round. The controller's sink sends them as NVFlare analytics events
(:mod:`fedweigh.flare.tracking`).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from fedweigh.io import atomic_write_text
from fedweigh.plots import plot_client_weights, plot_metric_by_round
from fedweigh.protocol import AUC_PLOT, METRICS_CSV, METRICS_JSON, WEIGHTS_PLOT
from fedweigh.server.rounds import RoundOutcome
from fedweigh.server.validation import check_site_metrics

__all__ = [
    "METRIC_LABELS",
    "RoundRecorder",
    "ScalarSink",
    "load_rows",
    "metric_tag",
    "value_tag",
    "weight_tag",
]

logger = logging.getLogger("fedweigh.recorder")

#: Receives one scalar of a row: ``(tag, value, step)``, the step being the row's round.
ScalarSink = Callable[[str, float, int], None]


def metric_tag(name: str) -> str:
    """Tag of a metric of the global model (``val_auc`` -> ``global/val_auc``)."""
    return f"global/{name}"


def weight_tag(site: str) -> str:
    """Tag of a site's weight in a round (``site-1`` -> ``weight/site-1``, the CSV's column)."""
    return f"weight/{site}"


def value_tag(name: str) -> str:
    """Tag of a value the server records with a round (the scheme's ``lambda``, ``round_seconds``, ...)."""
    return f"scheme/{name}"


#: How the metrics plot labels a row's scores (GM needs a threshold: the sites score it at 0.5).
METRIC_LABELS = {
    "test_auc": "test AUC",
    "val_auc": "val AUC",
    "test_gm": "test GM at threshold 0.5",
    "val_gm": "val GM at threshold 0.5",
}


class RoundRecorder:
    """Collects one row per round and writes them after each round (so a crash loses nothing).

    A row: ``round`` (the global model after that many rounds; 0 = initial model), the averaged
    client metrics of that model (``test_auc``, ``val_auc``, ...; under their own names, never one
    of the server's fields: :meth:`set_site_metrics`), and for training rounds the
    sites, their weights and the scheme's schedule values, the sites whose result was left out
    (``excluded``: site -> reason), those whose update was scaled down to the norm bound
    (``bounded``: site -> norms; only when there are any) and whether the global model changed
    (``global_updated``).
    """

    def __init__(
        self,
        out_dir: str | Path | None,
        scheme: str,
        rows: list[dict] | None = None,
        sinks: Sequence[ScalarSink] = (),
        tensorboard: bool = True,
    ):
        """``sinks``: called with every finite scalar of a row as it is recorded; ``tensorboard``:
        also write them to ``<out_dir>/tb_events/global`` (off where the sinks reach TensorBoard)."""
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.scheme = scheme
        self.rows: list[dict] = list(rows or [])
        self.sinks: list[ScalarSink] = list(sinks)
        self._tb = None if tensorboard else False
        self._sink_failed: set[int] = set()
        #: names the server wrote on a row besides the fixed fields (the scheme's values,
        #: ``round_seconds``, ...): the sites' metrics may not take them
        self._server_keys: set[str] = set()

    # -- writing -------------------------------------------------------------------------------
    def _writer(self):
        if self.out_dir is None:
            return None
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.out_dir / "tb_events" / "global"))
            except Exception as e:  # tensorboard missing: records still go to JSON/CSV
                logger.warning("TensorBoard events disabled: %s", e)
                self._tb = False
        return self._tb or None

    def _scalar(self, tag: str, value: float, step: int) -> None:
        """One finite scalar to the TensorBoard writer and every sink; a failing sink is logged
        (once) and the record goes on."""
        if not math.isfinite(value):
            return
        tb = self._writer()
        if tb is not None:
            tb.add_scalar(tag, value, step)
        for i, sink in enumerate(self.sinks):
            try:
                sink(tag, value, step)
            except Exception as e:  # a tracking failure never stops the round's record
                if i not in self._sink_failed:
                    self._sink_failed.add(i)
                    logger.warning("round %d: scalar %s not sent to %r: %s", step, tag, sink, e)

    def set_metrics(self, round_index: int, metrics: dict[str, float]) -> None:
        """Metrics of the global model after ``round_index`` rounds."""
        row = self._row(round_index)
        row.update({k: float(v) for k, v in metrics.items()})
        for key, value in metrics.items():
            self._scalar(metric_tag(key), float(value), round_index)

    def set_site_metrics(self, round_index: int, metrics: dict[str, float], who: str = "the sites") -> None:
        """The sites' (mean) metrics of the global model after ``round_index`` rounds, in their own
        names: a name the server's record uses (:func:`~fedweigh.server.validation.check_site_metrics`,
        the values the server wrote) is refused with a logged reason, so no site metric can
        overwrite or break a server field."""
        accepted, refused = check_site_metrics(who, metrics, self._server_keys)
        for why in refused.values():
            logger.warning("round %d: %s", round_index, why)
        if accepted:
            self.set_metrics(round_index, accepted)

    def set_round(self, round_index: int, weights: dict[str, float], values: dict[str, float]) -> None:
        """Sites, weights and schedule values of training round ``round_index``."""
        self._server_keys.update(values)
        row = self._row(round_index)
        row["weights"] = {k: float(v) for k, v in weights.items()}
        row.update({k: float(v) for k, v in values.items()})
        for site, weight in row["weights"].items():
            self._scalar(weight_tag(site), weight, round_index)
        for key, value in values.items():
            self._scalar(value_tag(key), float(value), round_index)

    def add_outcome(self, outcome: RoundOutcome, **values: float) -> None:
        """Record one round: the sites' mean metrics on the model they received (row t - 1), the
        excluded sites, and, when the global model changed, the weights, the scheme's values and
        ``values`` (e.g. ``round_seconds``) on row t."""
        t = outcome.round_index
        if outcome.metrics:
            self.set_site_metrics(t - 1, outcome.metrics)
        self.set_excluded(t, outcome.excluded, updated=outcome.updated)
        if outcome.bounded:
            self._row(t)["bounded"] = dict(sorted(outcome.bounded.items()))
        if outcome.updated:
            self.set_round(t, outcome.weights, {**outcome.values, **values})

    def set_excluded(self, round_index: int, excluded: dict[str, str], updated: bool) -> None:
        """Sites whose result round ``round_index`` left out, with the reason, and whether the
        global model changed in that round."""
        row = self._row(round_index)
        row["excluded"] = dict(sorted(excluded.items()))
        row["global_updated"] = bool(updated)

    def _row(self, round_index: int) -> dict:
        for row in self.rows:
            if row["round"] == round_index:
                return row
        row = {"round": round_index}
        self.rows.append(row)
        self.rows.sort(key=lambda r: r["round"])
        return row

    def flush(self) -> None:
        if self.out_dir is None:
            return
        atomic_write_text(
            self.out_dir / METRICS_JSON, json.dumps({"scheme": self.scheme, "rounds": self.rows}, indent=1)
        )
        scalar_keys = sorted(
            {k for r in self.rows for k in r if k not in ("round", "weights", "excluded", "bounded")}
        )
        sites = sorted({s for r in self.rows for s in r.get("weights", {})})
        table = io.StringIO()
        writer = csv.writer(table)
        writer.writerow(["round", *scalar_keys, *[weight_tag(s) for s in sites], "excluded_sites"])
        for r in self.rows:
            w = r.get("weights", {})
            writer.writerow(
                [
                    r["round"],
                    *[r.get(k, "") for k in scalar_keys],
                    *[w.get(s, "") for s in sites],
                    ";".join(r.get("excluded", {})),
                ]
            )
        atomic_write_text(self.out_dir / METRICS_CSV, table.getvalue())
        if self._tb:
            self._tb.flush()

    def plot(self, youden: tuple[int, float] | None = None) -> list[Path]:
        """Client-weight stacked area (rounds that kept the model shaded, not interpolated) and
        AUC/GM by round (GM at threshold 0.5, labelled so; ``youden``: (round, GM) of the final
        model at per-finding Youden thresholds, drawn as a point); returns the written paths."""
        if self.out_dir is None:
            return []
        written: list[Path] = []
        weighted = [r for r in self.rows if r.get("weights")]
        if weighted:
            written.append(
                plot_client_weights(
                    [r["round"] for r in weighted],
                    [r["weights"] for r in weighted],
                    self.out_dir / WEIGHTS_PLOT,
                    title=f"{self.scheme}: client weights by round",
                    skipped=[r["round"] for r in self.rows if r.get("global_updated") is False],
                )
            )
        keys = [k for k in ("test_auc", "test_gm", "val_auc", "val_gm") if any(k in r for r in self.rows)]
        if keys:
            rows = [r for r in self.rows if all(k in r for k in keys)]
            if rows:
                written.append(
                    plot_metric_by_round(
                        [r["round"] for r in rows],
                        {METRIC_LABELS.get(k, k): [r[k] for r in rows] for k in keys},
                        self.out_dir / AUC_PLOT,
                        ylabel="macro score",
                        title=f"{self.scheme}: global model by round",
                        points={"test GM at Youden thresholds (final model)": youden} if youden else None,
                    )
                )
        return written

    def close(self) -> None:
        if self._tb:
            self._tb.close()
            self._tb = None


def load_rows(path: str | Path) -> list[dict]:
    """Rows of a metrics JSON written by :class:`RoundRecorder`."""
    data = json.loads(Path(path).read_text())
    return list(data.get("rounds", []))
