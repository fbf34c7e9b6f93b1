"""The user's own model: any torch.nn.Module (a MONAI network works the same way)."""

from __future__ import annotations

from torch import nn


class TinyNet(nn.Module):
    """A small CNN for 1 x 16 x 16 images and ``num_classes`` classes.

    NVFlare rebuilds the model at the server from its constructor arguments, which it finds as
    attributes of the same name: keep them as ``self.<arg>``.
    """

    def __init__(self, num_classes: int = 4, width: int = 8):
        super().__init__()
        self.num_classes = num_classes
        self.width = width
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))
