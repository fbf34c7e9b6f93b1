"""Where a site's data comes from: the scenario (simulation) or a site-local setting (deployment).

In the simulator a site's data follows from its name (``site-3``) and the job's scenario. In a real
deployment the data location is a site-local setting, never part of the job: a JSON file named by
the ``FEDWEIGH_SITE_CONFIG`` environment variable, or ``fedweigh_site.json`` in the site's
``local/`` folder (or the client's working directory). Example::

    {"dataset": "chestmnist", "data_path": "/data/chestmnist_64.npz", "size": 64}
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from fedweigh.checks import check_site_values
from fedweigh.data import build_federation, load_pool
from fedweigh.data.base import LabeledImages, SiteData
from fedweigh.errors import ConfigError
from fedweigh.protocol import SITE_CONFIG_ENV, SITE_CONFIG_FILE
from fedweigh.secure.contexts import STARTUP_FOLDER, find_site_root, is_provisioned

logger = logging.getLogger("fedweigh.site")


@dataclass
class SiteDataConfig:
    """A site's local data settings (deployment mode)."""

    dataset: str
    data_path: str | None = None
    loader_options: dict = field(default_factory=dict)
    size: int = 32
    val_fraction: float = 0.1
    seed: int = 0
    num_images: int | None = None

    @classmethod
    def from_file(cls, path: str | Path) -> SiteDataConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise FileNotFoundError(f"site data config {path} does not exist") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"site data config {path} is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError(f"site data config {path} must hold a JSON object, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(
                f"site data config {path}", "field(s)", unknown, f"known fields: {', '.join(sorted(known))}"
            )
        if "dataset" not in raw:
            raise ConfigError(f"site data config {path}", "dataset", None, "the field is required")
        cfg = cls(**raw)
        check_site_values(vars(cfg), f"site data config {path}")
        return cfg


def find_site_config(workspace: str | Path | None = None) -> Path | None:
    """The site-local data config, if this site has one (env variable first, then local/ files)."""
    env = os.environ.get(SITE_CONFIG_ENV)
    if env:
        path = Path(env)
        if not path.is_file():
            raise FileNotFoundError(f"{SITE_CONFIG_ENV}={env} does not name an existing file")
        return path
    roots = [Path(workspace)] if workspace else []
    roots.append(Path.cwd())
    for root in roots:
        for candidate in (root / "local" / SITE_CONFIG_FILE, root / SITE_CONFIG_FILE):
            if candidate.is_file():
                return candidate
    return None


def split_train_val(
    data: LabeledImages, val_fraction: float, seed: int
) -> tuple[LabeledImages, LabeledImages]:
    """Deterministic random train/validation split of one site's data."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(data))
    n_val = max(1, int(round(val_fraction * len(data))))
    return data.subset(np.sort(order[n_val:])), data.subset(np.sort(order[:n_val]))


def load_site_from_config(site_name: str, cfg: SiteDataConfig) -> tuple[SiteData, LabeledImages]:
    """A deployed site's train/val splits and its local test set, from its own data."""
    pool, test = load_pool(
        cfg.dataset,
        data_path=expand_data_path(cfg.data_path),
        size=cfg.size,
        seed=cfg.seed,
        num_images=cfg.num_images,
        **cfg.loader_options,
    )
    train, val = split_train_val(pool, cfg.val_fraction, cfg.seed)
    return SiteData(name=site_name, train=train, val=val), test


def load_site_from_scenario(
    site_name: str,
    scenario: str,
    dataset: str,
    *,
    data_path: str | None,
    loader_options: dict | None = None,
    size: int,
    seed: int,
    num_images: int | None,
    test_images: int | None = None,
) -> tuple[SiteData, LabeledImages, int]:
    """A simulated site's splits, the global test set, and the scenario's number of sites."""
    fed = build_federation(
        scenario,
        dataset,
        data_path=data_path,
        size=size,
        seed=seed,
        num_images=num_images,
        loader_options=loader_options,
        test_images=test_images,
    )
    try:
        site = fed.site(site_name)
    except KeyError as e:
        raise KeyError(
            f"{e.args[0]}. In a deployment, give this site its own data with a {SITE_CONFIG_FILE} in its "
            f"local/ folder or the {SITE_CONFIG_ENV} environment variable."
        ) from None
    return site, fed.test, len(fed.sites)


def expand_data_path(path: str | None) -> str | None:
    """``path`` with environment variables expanded; a clear error if one is not set."""
    if path is None:
        return None
    expanded = os.path.expandvars(path)
    if "$" in expanded:
        raise ValueError(
            f"data path {path!r} names an environment variable that is not set at this site; "
            "set it to the dataset's location (e.g. export FEDWEIGH_CHESTMNIST=/data/chestmnist_64.npz)"
        )
    return expanded


def provisioned_kit(start: str | Path | None = None) -> Path | None:
    """The provisioned (or POC) startup kit this process runs in (at or above ``start``, default
    cwd), if any; None in the simulator."""
    root = find_site_root(start)
    return root if root is not None and is_provisioned(root / STARTUP_FOLDER) else None


def resolve_site_data(site_name: str, args, workspace: str | Path | None = None):
    """(site splits, test set, number of sites): from the site-local config if there is one, else the
    job's scenario (simulation). A provisioned site without a config is warned about: it trains on
    the job's simulated data, which is rarely what a deployment means."""
    kit = provisioned_kit(workspace)
    config_path = find_site_config(workspace) or (find_site_config(kit) if kit is not None else None)
    if config_path is not None:
        cfg = SiteDataConfig.from_file(config_path)
        site, test = load_site_from_config(site_name, cfg)
        return site, test, 1
    if kit is not None:
        logger.warning(
            "%s: a provisioned site without %s (looked in %s and %s): it trains on the job's simulated data "
            "(scenario %s, dataset %s) as in the simulator; give it its own data in local/%s (docs/deploy.md, "
            "`fedweigh site check --load`)",
            site_name,
            SITE_CONFIG_FILE,
            kit / "local",
            Path.cwd(),
            args.scenario,
            args.dataset,
            SITE_CONFIG_FILE,
        )
    return load_site_from_scenario(
        site_name,
        args.scenario,
        args.dataset,
        data_path=expand_data_path(args.data_path),
        loader_options=args.loader_options,
        size=args.size,
        seed=args.seed,
        num_images=args.num_images,
        test_images=getattr(args, "test_images", None),
    )
