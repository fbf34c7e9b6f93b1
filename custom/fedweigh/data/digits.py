"""scikit-learn's handwritten digits (UCI optdigits test set): 1797 8x8 images, 10 classes, offline.

A small real multi-class dataset for label-skew experiments that needs no download: it ships inside
scikit-learn. Pixel values 0..16 are scaled to [0, 1] and up-sampled (bilinear) to ``size``.
"""

from __future__ import annotations

import numpy as np

from fedweigh.data.base import LabeledImages
from fedweigh.data.chestmnist import resize_images

DIGIT_CLASSES: tuple[str, ...] = tuple(str(d) for d in range(10))


def load_digits_dataset(size: int = 32) -> LabeledImages:
    """All 1797 digits as multi-class LabeledImages: images (1797, 1, size, size) = pixel / 16."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (bunch.images.astype(np.float32) / np.float32(16.0))[:, None]
    return LabeledImages(
        images=resize_images(images, size),
        labels=bunch.target.astype(np.int64),
        class_names=DIGIT_CLASSES,
        task="multiclass",
        meta={"source": "sklearn.datasets.load_digits"},
    )
