"""The federations a benchmark's cells train on: built once per process and key, restricted to the
configured sites, pooled for the centralized reference, or without their test set for tuning."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from fedweigh.bench.config import BenchConfig
from fedweigh.data import build_federation
from fedweigh.data.base import Federation, LabeledImages, SiteData
from fedweigh.site.data_config import expand_data_path

__all__ = ["declared_sizes", "federation_for", "pool_sites", "without_test"]

_FEDERATIONS: OrderedDict[tuple, Federation] = OrderedDict()
_FEDERATION_CACHE_SIZE = 2


def declared_sizes(fed: Federation) -> dict[str, int]:
    """The consortium's declaration of the federation's sizes: each site's true training-set size
    (``Safeguards.declared_sizes``, as a consortium provisions its sites)."""
    return {s.name: len(s.train) for s in fed.sites}


def federation_for(config: BenchConfig, scenario: str, seed: int) -> Federation:
    """The scenario's federation (restricted to ``config.sites``), built once per process and key."""
    c = config.client
    key = (
        config.dataset,
        c.data_path,
        json.dumps(c.loader_options, sort_keys=True),
        scenario,
        c.size,
        seed,
        c.num_images,
        c.test_images,
        config.scenario(scenario),
        config.sites,
    )
    if key in _FEDERATIONS:
        _FEDERATIONS.move_to_end(key)
        return _FEDERATIONS[key]
    fed = build_federation(
        config.scenario(scenario),
        config.dataset,
        data_path=expand_data_path(c.data_path),
        size=c.size,
        seed=seed,
        num_images=c.num_images,
        loader_options=c.loader_options,
        test_images=c.test_images,
    )
    if config.sites:
        names = [s.name for s in fed.sites]
        unknown = [s for s in config.sites if s not in names]
        if unknown:
            raise ValueError(f"sites {unknown} are not in scenario {scenario!r} (sites: {', '.join(names)})")
        fed = replace(fed, sites=[s for s in fed.sites if s.name in config.sites])
    _FEDERATIONS[key] = fed
    while len(_FEDERATIONS) > _FEDERATION_CACHE_SIZE:
        _FEDERATIONS.popitem(last=False)
    return fed


def pool_sites(sites: Sequence[SiteData]) -> SiteData:
    """All sites' train and val splits concatenated (the centralized reference's data)."""

    def cat(parts: list[LabeledImages]) -> LabeledImages:
        first = parts[0]
        domains = [p.domain for p in parts]
        return LabeledImages(
            images=np.concatenate([p.images for p in parts]),
            labels=np.concatenate([p.labels for p in parts]),
            class_names=first.class_names,
            task=first.task,
            domain=None if any(d is None for d in domains) else np.concatenate(domains),
            meta={**first.meta, "site": "pooled"},
        )

    return SiteData(name="pooled", train=cat([s.train for s in sites]), val=cat([s.val for s in sites]))


def without_test(fed: Federation) -> Federation:
    """``fed`` with an empty test set (same classes and image shape): what a tuning cell trains on,
    so that nothing in it can read a test image or label."""
    return replace(fed, test=fed.test.subset(np.arange(0)))
