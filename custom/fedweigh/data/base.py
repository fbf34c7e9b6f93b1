"""The array-level data contract shared by every dataset, scenario and training loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Task = Literal["multilabel", "multiclass"]

#: The 14 ChestMNIST / NIH ChestX-ray14 findings, in ChestMNIST's label order.
CHEST_FINDINGS: tuple[str, ...] = (
    "atelectasis",
    "cardiomegaly",
    "effusion",
    "infiltration",
    "mass",
    "nodule",
    "pneumonia",
    "pneumothorax",
    "consolidation",
    "edema",
    "emphysema",
    "fibrosis",
    "pleural",
    "hernia",
)


@dataclass
class LabeledImages:
    """Images and their labels, held in memory.

    images: float32, shape (N, C, H, W), values in [0, 1].
    labels: float32 (N, num_classes) of 0/1 for ``multilabel``; int64 (N,) for ``multiclass``.
    class_names: one name per class / finding.
    domain: optional int64 (N,) acquisition-domain id (e.g. the hospital whose scanner took it).
    """

    images: np.ndarray
    labels: np.ndarray
    class_names: tuple[str, ...]
    task: Task
    domain: np.ndarray | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.images.ndim != 4:
            raise ValueError(f"images must have shape (N, C, H, W), got {self.images.shape}")
        n = self.images.shape[0]
        if self.labels.shape[0] != n:
            raise ValueError(f"{n} images but {self.labels.shape[0]} labels")
        if self.task == "multilabel" and (
            self.labels.ndim != 2 or self.labels.shape[1] != len(self.class_names)
        ):
            raise ValueError(
                f"multilabel labels must have shape (N, {len(self.class_names)}), got {self.labels.shape}"
            )
        if self.task == "multiclass" and self.labels.ndim != 1:
            raise ValueError(f"multiclass labels must have shape (N,), got {self.labels.shape}")
        if self.domain is not None and self.domain.shape != (n,):
            raise ValueError(f"domain must have shape ({n},), got {self.domain.shape}")

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def subset(self, index: np.ndarray) -> LabeledImages:
        """Rows ``index`` as a new LabeledImages (copies)."""
        index = np.asarray(index, dtype=np.int64)
        return LabeledImages(
            images=self.images[index],
            labels=self.labels[index],
            class_names=self.class_names,
            task=self.task,
            domain=None if self.domain is None else self.domain[index],
            meta=dict(self.meta),
        )

    def label_histogram(self) -> np.ndarray:
        """Positives per class (multilabel; ignored NaN entries not counted) or samples per class, int64."""
        if self.task == "multilabel":
            return np.nansum(self.labels, axis=0).round().astype(np.int64)
        return np.bincount(self.labels.astype(np.int64), minlength=self.num_classes).astype(np.int64)


@dataclass
class SiteData:
    """One site's local splits."""

    name: str
    train: LabeledImages
    val: LabeledImages


@dataclass
class Federation:
    """A partitioned dataset: per-site train/val splits and one global test set."""

    scenario: str
    sites: list[SiteData]
    test: LabeledImages
    sample_fraction: float = 1.0

    def site(self, name: str) -> SiteData:
        for s in self.sites:
            if s.name == name:
                return s
        known = ", ".join(s.name for s in self.sites)
        raise KeyError(f"site {name!r} is not in scenario {self.scenario!r} (sites: {known})")
