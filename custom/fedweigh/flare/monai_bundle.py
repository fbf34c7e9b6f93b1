"""A MONAI Bundle as a site's training under a fedweigh scheme, through MONAI's federated interface.

``monai.fl.client.MonaiAlgo`` runs a bundle's training config (``configs/train.json``: its
``train#trainer``, a ``SupervisedTrainer``) for ``local_epochs`` per round, and its evaluation config
when the bundle has one (:class:`BundleSite`). The NVFlare Client API loop of this module
(:func:`main`, run by the entry script ``monai_bundle_client.py``) wraps it: each ``train`` task loads
the global model into the bundle's network, trains, and answers with the full local model and the meta
the fedweigh server weighs a site by (:mod:`fedweigh.flare.byo`): ``num_samples`` = the size of the
bundle's training dataset, ``NUM_STEPS_CURRENT_ROUND`` = the iterations MONAI ran, and the scheme's
scalars computed from the label counts of the training data list. FedProx's proximal term is added to
the bundle's loss when the scheme asks for it. The job is built by
:class:`fedweigh.flare.monai_bundle_recipe.MonaiBundleRecipe`; config overrides come from its
``--override KEY=VALUE`` arguments and the site's own JSON file named by ``FEDWEIGH_BUNDLE_OVERRIDES``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import nvflare.client as flare
import torch
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

from fedweigh.errors import BundleError
from fedweigh.flare.byo import answer_statistics, global_statistics, is_statistics_task, plan_of, result_meta
from fedweigh.flare.task_loop import serve
from fedweigh.protocol import META_NUM_SAMPLES, TASK_TRAIN
from fedweigh.train import fedprox_term

__all__ = [
    "DEFAULT_EVAL_CONFIG",
    "DEFAULT_TRAIN_CONFIG",
    "SITE_OVERRIDES_ENV",
    "BundleError",
    "BundleSite",
    "answer_task",
    "label_counts",
    "main",
    "parse_args",
    "parse_overrides",
    "site_overrides",
]

logger = logging.getLogger("fedweigh.monai_bundle")

#: Environment variable naming a site-local JSON object of bundle config overrides (e.g. data paths).
SITE_OVERRIDES_ENV = "FEDWEIGH_BUNDLE_OVERRIDES"
DEFAULT_TRAIN_CONFIG = "configs/train.json"
DEFAULT_EVAL_CONFIG = "configs/evaluate.json"


def label_counts(items: Sequence[Any], label_key: str, num_classes: int | None, where: str) -> np.ndarray:
    """Per-class counts of the labels of a bundle's data list (``[{"image": ..., "label": ...}, ...]``).

    A label that is a number is a class index (multi-class; needs ``num_classes``); a list is a
    multi-hot vector (multi-label: positives per finding).
    """
    if not items:
        raise BundleError(f"{where}: the training data list is empty")
    labels = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping) or label_key not in item:
            raise BundleError(f"{where}: item {i} has no {label_key!r} (label_key names the label field)")
        labels.append(item[label_key])
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in labels):
        if num_classes is None:
            raise BundleError(f"{where}: labels are class indices: pass num_classes (the number of classes)")
        index = np.asarray(labels, dtype=np.int64)
        bad = np.flatnonzero((index < 0) | (index >= num_classes))
        if bad.size:
            raise BundleError(
                f"{where}: item {int(bad[0])} has label {int(index[bad[0]])}, not a class 0..{num_classes - 1}"
            )
        return np.bincount(index, minlength=num_classes).astype(np.int64)
    try:
        hot = np.asarray(labels, dtype=np.float64)
    except (TypeError, ValueError):
        hot = np.empty(0)
    if hot.ndim != 2 or not np.isin(hot, (0.0, 1.0)).all():
        raise BundleError(
            f"{where}: {label_key!r} must be a class index in every item or a 0/1 vector of one length in every item"
        )
    if num_classes is not None and hot.shape[1] != num_classes:
        raise BundleError(f"{where}: labels have {hot.shape[1]} entries, num_classes is {num_classes}")
    return hot.sum(axis=0).round().astype(np.int64)


def parse_overrides(pairs: Sequence[str], site_name: str) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as bundle config overrides: VALUE read as JSON when it parses, else a
    string; ``{site}`` in a string becomes ``site_name``."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise BundleError(f"override {pair!r}: expected KEY=VALUE (a bundle config id and its value)")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        out[key] = value.replace("{site}", site_name) if isinstance(value, str) else value
    return out


def site_overrides(site_name: str) -> dict[str, Any]:
    """The site-local overrides of the JSON file named by ``FEDWEIGH_BUNDLE_OVERRIDES`` (none if unset)."""
    path = os.environ.get(SITE_OVERRIDES_ENV)
    if not path:
        return {}
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise BundleError(f"{SITE_OVERRIDES_ENV}={path}: no such file") from None
    except json.JSONDecodeError as e:
        raise BundleError(f"{SITE_OVERRIDES_ENV}={path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise BundleError(f"{SITE_OVERRIDES_ENV}={path}: must hold a JSON object of config id -> value")
    return {k: v.replace("{site}", site_name) if isinstance(v, str) else v for k, v in raw.items()}


class _ProximalLoss(torch.nn.Module):
    """The bundle's loss plus FedProx's (mu / 2) ||theta - theta_g||^2."""

    def __init__(self, loss: Any, prox) -> None:
        super().__init__()
        self.loss = loss
        self.prox = prox

    def forward(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss(prediction, target) + self.prox()


class BundleSite:
    """One site's bundle run by ``MonaiAlgo``: train a round, evaluate, count labels.

    Args:
        bundle_root: the bundle folder (with ``configs/``).
        site_name: the site (MONAI's client name).
        local_epochs: epochs of the bundle's trainer per round.
        train_config: the training config, relative to the bundle root.
        eval_config: the evaluation config (read on top of the training config, as MonaiAlgo does);
            None: no evaluation.
        overrides: bundle config overrides (config id -> value) for training and evaluation.
        label_key: the label field of the training data list's items.
        num_classes: the number of classes, for labels that are class indices.
    """

    def __init__(
        self,
        bundle_root: str | Path,
        site_name: str,
        *,
        local_epochs: int = 1,
        train_config: str = DEFAULT_TRAIN_CONFIG,
        eval_config: str | None = None,
        overrides: Mapping[str, Any] | None = None,
        label_key: str = "label",
        num_classes: int | None = None,
    ) -> None:
        from monai.fl.client import MonaiAlgo
        from monai.fl.utils.constants import ExtraItems

        root = Path(bundle_root).resolve()
        for config in (train_config, eval_config):
            if config is not None and not (root / config).is_file():
                raise BundleError(f"{root / config}: no such bundle config")
        if isinstance(local_epochs, bool) or not isinstance(local_epochs, int) or local_epochs < 1:
            raise BundleError(f"local_epochs must be an integer >= 1, got {local_epochs!r}")
        self.site_name = site_name
        self.label_key = label_key
        self.num_classes = num_classes
        self.where = f"{root / train_config} at {site_name}"
        self.algo = MonaiAlgo(
            bundle_root=str(root),
            local_epochs=local_epochs,
            send_weight_diff=False,
            config_train_filename=train_config,
            train_kwargs=dict(overrides or {}),
            config_evaluate_filename=None if eval_config is None else [train_config, eval_config],
            eval_kwargs=dict(overrides or {}),
        )
        self.algo.initialize(extra={ExtraItems.CLIENT_NAME: site_name})
        self.trainer = self.algo.trainer
        self.bundle_loss = self.trainer.loss_function
        self._class_counts: np.ndarray | None = None

    @property
    def train_items(self) -> Sequence[Any]:
        """The items of the trainer's dataset (MONAI datasets keep their data list as ``.data``)."""
        dataset = self.trainer.data_loader.dataset
        items = getattr(dataset, "data", None)
        if items is None:
            raise BundleError(
                f"{self.where}: the training dataset ({type(dataset).__name__}) has no data list (.data); "
                "use a MONAI Dataset / CacheDataset over a list of dicts"
            )
        return items

    @property
    def num_samples(self) -> int:
        """N_k: the size of the bundle's training dataset."""
        return len(self.trainer.data_loader.dataset)

    @property
    def class_counts(self) -> np.ndarray:
        """Per-class label counts of the training data list (read once)."""
        if self._class_counts is None:
            self._class_counts = label_counts(self.train_items, self.label_key, self.num_classes, self.where)
        return self._class_counts

    def train_round(
        self, global_params: Mapping[str, Any], fedprox_mu: float = 0.0
    ) -> tuple[dict[str, torch.Tensor], int]:
        """Train the bundle from ``global_params`` for one round; (full local model, iterations run)."""
        from monai.fl.utils.constants import FlStatistics, WeightType
        from monai.fl.utils.exchange_object import ExchangeObject

        weights = {k: torch.as_tensor(np.asarray(v)) for k, v in global_params.items()}
        if fedprox_mu > 0:
            self.trainer.loss_function = _ProximalLoss(
                self.bundle_loss, fedprox_term(self.trainer.network, weights, fedprox_mu)
            )
        else:
            self.trainer.loss_function = self.bundle_loss
        self.algo.train(ExchangeObject(weights=weights, weight_type=WeightType.WEIGHTS))
        out = self.algo.get_weights()
        steps = int(out.statistics[FlStatistics.NUM_EXECUTED_ITERATIONS])
        return dict(out.weights), steps

    def evaluate(self, global_params: Mapping[str, Any]) -> dict[str, float]:
        """The evaluation config's metrics of ``global_params`` ({} without an evaluation config)."""
        from monai.fl.utils.constants import WeightType
        from monai.fl.utils.exchange_object import ExchangeObject

        if self.algo.evaluator is None:
            return {}
        weights = {k: torch.as_tensor(np.asarray(v)) for k, v in global_params.items()}
        out = self.algo.evaluate(ExchangeObject(weights=weights, weight_type=WeightType.WEIGHTS))
        return {str(k): float(v) for k, v in (out.metrics or {}).items() if np.isscalar(v)}

    def finalize(self) -> None:
        self.algo.finalize()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The arguments of the bundle client script (the job's ``train_args``)."""
    p = argparse.ArgumentParser(description="a MONAI Bundle as a fedweigh site's training")
    p.add_argument("--bundle-root", required=True, help="bundle folder (relative: to the script's folder)")
    p.add_argument("--train-config", default=DEFAULT_TRAIN_CONFIG)
    p.add_argument("--eval-config", default=None, help="evaluation config (default: none)")
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--label-key", default="label")
    p.add_argument("--num-classes", type=int, default=None)
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    return p.parse_args(argv)


def _resolve_root(bundle_root: str, script_dir: Path) -> Path:
    """The bundle folder: an absolute path, or one relative to the script's folder or a folder above it
    up to the app's ``custom/`` folder (where the recipe ships it), or to the working directory."""
    root = Path(bundle_root)
    if root.is_absolute():
        return root
    bases = [script_dir]
    for parent in script_dir.parents:
        if script_dir.name == "custom":
            break
        bases.append(parent)
        if parent.name == "custom":
            break
    bases.append(Path.cwd())
    for base in bases:
        if (base / root).is_dir():
            return base / root
    raise BundleError(f"bundle {bundle_root!r} not found in {', '.join(map(str, bases))}")


def main(argv: Sequence[str] | None = None) -> None:
    """The Client API loop: statistics, train and evaluation tasks answered by the bundle."""
    logging.basicConfig(level=logging.INFO)
    flare.init()
    sites: list[BundleSite] = []

    def setup():
        args = parse_args(argv)
        site_name = flare.get_site_name()
        overrides = {**parse_overrides(args.override, site_name), **site_overrides(site_name)}
        site = BundleSite(
            _resolve_root(args.bundle_root, Path(sys.argv[0]).resolve().parent),
            site_name,
            local_epochs=args.local_epochs,
            train_config=args.train_config,
            eval_config=args.eval_config,
            overrides=overrides,
            label_key=args.label_key,
            num_classes=args.num_classes,
        )
        sites.append(site)
        logger.info("%s: bundle %s, %d training items", site_name, args.bundle_root, site.num_samples)
        return lambda received: answer_task(site, received)

    try:
        serve(setup)
    finally:
        for site in sites:
            site.finalize()


def answer_task(site: BundleSite, received: FLModel) -> FLModel:
    """The bundle site's answer to one task: statistics, evaluation of the global model, or training."""
    if is_statistics_task():
        return answer_statistics(received, site.class_counts, site.num_samples)
    if flare.get_task_name() != TASK_TRAIN:  # evaluation of the global model
        metrics = site.evaluate(received.params or {})
        return FLModel(metrics=metrics, meta={META_NUM_SAMPLES: site.num_samples})
    plan = plan_of(received)
    mu = float(plan.get("fedprox_mu", 0.0) or 0.0)
    params, steps = site.train_round(received.params, mu)
    needs_counts = bool(plan.get("scalars"))
    return FLModel(
        params=params,
        params_type=ParamsType.FULL,
        metrics=site.evaluate(params),
        meta=result_meta(
            received,
            num_samples=site.num_samples,
            num_steps=steps,
            class_counts=site.class_counts if needs_counts else None,
            params=params,
            global_stats=global_statistics(),
        ),
    )
