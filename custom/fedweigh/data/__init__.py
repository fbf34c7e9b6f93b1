"""Datasets as in-memory arrays, and the scenario catalogue that splits them into sites.

Datasets: ``synthcxr`` (embedded, generated), ``chestmnist`` (a MedMNIST ``.npz``), ``chexpert``
(csv + images) and ``digits`` (scikit-learn). :func:`load_pool` (:mod:`fedweigh.data.pools`) returns a
dataset's training pool (what the scenarios partition) and its global test set;
:func:`build_federation` (:mod:`fedweigh.data.scenarios`) does the rest. Where a deployed site's data
comes from: :mod:`fedweigh.site.data_config`.
"""

from __future__ import annotations

from fedweigh.data.base import CHEST_FINDINGS, Federation, LabeledImages, SiteData, Task
from fedweigh.data.chestmnist import load_medmnist_npz, resize_images
from fedweigh.data.chexpert import (
    CHEXPERT_FINDINGS,
    CHEXPERT_LABELS,
    CHEXPERT_PATHOLOGIES,
    load_chexpert,
)
from fedweigh.data.digits import DIGIT_CLASSES, load_digits_dataset
from fedweigh.data.pools import (
    DATASETS,
    DIGITS_TEST_FRACTION,
    SYNTHCXR_DEFAULT_IMAGES,
    dataset_info,
    find_medmnist_file,
    load_pool,
)
from fedweigh.data.scenarios import (
    SCENARIOS,
    Scenario,
    build_federation,
    get_scenario,
    list_scenarios,
    partition_indices,
    primary_labels,
    scenario_table,
    site_label_divergence,
    site_mixes,
)
from fedweigh.data.shift import AcquisitionProfile, apply_acquisition_shift, site_profile
from fedweigh.data.synthcxr import generate_synthcxr, load_synthcxr
from fedweigh.errors import DatasetFormatError

__all__ = [
    "CHEST_FINDINGS",
    "CHEXPERT_FINDINGS",
    "CHEXPERT_LABELS",
    "CHEXPERT_PATHOLOGIES",
    "DATASETS",
    "DIGITS_TEST_FRACTION",
    "SYNTHCXR_DEFAULT_IMAGES",
    "DIGIT_CLASSES",
    "SCENARIOS",
    "AcquisitionProfile",
    "DatasetFormatError",
    "Federation",
    "LabeledImages",
    "Scenario",
    "SiteData",
    "Task",
    "apply_acquisition_shift",
    "build_federation",
    "dataset_info",
    "find_medmnist_file",
    "generate_synthcxr",
    "get_scenario",
    "list_scenarios",
    "load_chexpert",
    "load_digits_dataset",
    "load_medmnist_npz",
    "load_pool",
    "load_synthcxr",
    "partition_indices",
    "primary_labels",
    "resize_images",
    "scenario_table",
    "site_label_divergence",
    "site_mixes",
    "site_profile",
]
