"""The recipe of a MONAI Bundle job: a fedweigh scheme at the server, the bundle as every site's training.

    recipe = MonaiBundleRecipe(method="fedbb", bundle_root="my_bundle", min_clients=3, num_rounds=5,
                               num_classes=4, overrides={"dataset_dir": "/data/cxr/{site}"})
    recipe.export("jobs")

The bundle ships in the job's ``custom/`` folder with the bundle client script
(:mod:`fedweigh.flare.monai_bundle`); the global model is the bundle's ``network_def``
(:func:`bundle_model`). Config ``overrides`` are applied at every site (``{site}`` becomes the site's
name); a site adds its own (e.g. where its data lie) in the JSON file named by
``FEDWEIGH_BUNDLE_OVERRIDES``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from nvflare.apis.job_def import ALL_SITES

from fedweigh.errors import BundleError, ConfigError
from fedweigh.flare.monai_bundle import DEFAULT_EVAL_CONFIG, DEFAULT_TRAIN_CONFIG
from fedweigh.flare.recipes import MethodRecipe

__all__ = ["BUNDLE_CLIENT_SCRIPT", "MonaiBundleRecipe", "bundle_model", "bundle_network"]

#: The Client API script the recipe ships; it runs :func:`fedweigh.flare.monai_bundle.main`.
BUNDLE_CLIENT_SCRIPT = str(Path(__file__).with_name("monai_bundle_client.py"))


def bundle_network(
    bundle_root: str | Path, train_config: str = DEFAULT_TRAIN_CONFIG, network_id: str = "network_def"
) -> torch.nn.Module:
    """The network the bundle's training config defines under ``network_id`` (the global model)."""
    from monai.bundle import ConfigParser

    config = Path(bundle_root) / train_config
    if not config.is_file():
        raise BundleError(f"{config}: no such bundle config (train_config is relative to the bundle root)")
    parser = ConfigParser()
    parser.read_config(str(config))
    if network_id not in parser:
        raise BundleError(f"{config}: no {network_id!r} entry (network_id names the bundle's network)")
    network = parser.get_parsed_content(network_id)
    if not isinstance(network, torch.nn.Module):
        raise BundleError(f"{config}: {network_id!r} is a {type(network).__name__}, not a torch.nn.Module")
    return network


def bundle_model(
    bundle_root: str | Path, train_config: str = DEFAULT_TRAIN_CONFIG, network_id: str = "network_def"
) -> dict[str, Any]:
    """The bundle's network in NVFlare's model form ``{"path": "pkg.Class", "args": {...}}``.

    The arguments are the network entry's, resolved by the bundle's config parser (references such as
    ``"@num_classes"`` become values); the server builds the global model from them.
    """
    from monai.bundle import ConfigParser

    network = bundle_network(bundle_root, train_config, network_id)
    parser = ConfigParser()
    parser.read_config(str(Path(bundle_root) / train_config))
    entry = parser.get(network_id)
    if not isinstance(entry, dict) or "_target_" not in entry:
        raise BundleError(
            f"{Path(bundle_root) / train_config}: {network_id!r} must be a component ({{'_target_': ..., args}})"
        )
    args = {k: parser.get_parsed_content(f"{network_id}#{k}") for k in entry if not k.startswith("_")}
    try:
        json.dumps(args)
    except TypeError as e:
        raise BundleError(
            f"{Path(bundle_root) / train_config}: {network_id!r} has arguments that are not plain values ({e}); "
            "pass the recipe a model= instead"
        ) from None
    return {"path": f"{type(network).__module__}.{type(network).__name__}", "args": args}


class MonaiBundleRecipe(MethodRecipe):
    """A fedweigh method with a MONAI Bundle as every site's training (module docstring).

    Args:
        bundle_root: the bundle folder on this machine (shipped in the job).
        method: catalogue method whose weighting scheme the server runs (``fedavg``, ``feddraw``,
            ``fedbb``, ``dafl``, ...); the sites train with the bundle's own loss.
        model: the global model; default: the bundle's ``network_def`` (:func:`bundle_model`), which
            the server builds with fresh weights (``initial_ckpt`` names weights to start from).
        local_epochs: epochs of the bundle's trainer per round.
        train_config, eval_config: the bundle's configs (relative to its root); eval_config None:
            ``configs/evaluate.json`` when the bundle has one, else no evaluation.
        overrides: bundle config overrides at every site; ``{site}`` in a string value becomes the
            site's name. Values must not contain spaces (they travel as command-line arguments).
        label_key: the label field of the training data list's items.
        num_classes: the number of classes, when labels are class indices and the scheme counts them.
        Other keywords: as :class:`MethodRecipe` (``num_rounds``, ``min_clients``, ``scheme_args``, ...).
    """

    def __init__(
        self,
        *,
        bundle_root: str | Path,
        method: str = "fedavg",
        name: str | None = None,
        model: Any = None,
        local_epochs: int = 1,
        train_config: str = DEFAULT_TRAIN_CONFIG,
        eval_config: str | None = None,
        overrides: Mapping[str, Any] | None = None,
        label_key: str = "label",
        num_classes: int | None = None,
        **kwargs: Any,
    ) -> None:
        root = Path(bundle_root).resolve()
        where = f"recipe {name or method!r}"
        if not (root / train_config).is_file():
            raise ConfigError(where, "bundle_root", str(bundle_root), f"a bundle folder with {train_config}")
        if eval_config is None and (root / DEFAULT_EVAL_CONFIG).is_file():
            eval_config = DEFAULT_EVAL_CONFIG
        if eval_config is not None and not (root / eval_config).is_file():
            raise ConfigError(where, "eval_config", eval_config, f"a config file under {root}")
        if isinstance(local_epochs, bool) or not isinstance(local_epochs, int) or local_epochs < 1:
            raise ConfigError(where, "local_epochs", local_epochs, "an integer >= 1")
        argv = [f"--bundle-root {root.name}", f"--train-config {train_config}"]
        argv += [f"--local-epochs {local_epochs}", f"--label-key {label_key}"]
        if eval_config is not None:
            argv.append(f"--eval-config {eval_config}")
        if num_classes is not None:
            argv.append(f"--num-classes {int(num_classes)}")
        for key, value in (overrides or {}).items():
            text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
            if any(c.isspace() for c in f"{key}{text}"):
                raise ConfigError(where, f"overrides[{key!r}]", value, "a value without spaces")
            argv.append(f"--override {key}={text}")
        if model is None:
            model = bundle_model(root, train_config)
        super().__init__(
            method=method,
            name=name,
            model=model,
            train_script=BUNDLE_CLIENT_SCRIPT,
            train_args=" ".join(argv),
            **kwargs,
        )
        self._job.add_file_to(str(root), ALL_SITES, dest_dir=root.name)  # custom/<bundle name>/
        # MONAI runs the bundle at every site, so it is installed there: the job refers to the network's
        # class instead of carrying MONAI's source (and what it imports) in custom/
        installed = ["monai"] if kwargs.get("bundle") else ["fedweigh", "monai"]
        self._job.set_app_packages(installed)
