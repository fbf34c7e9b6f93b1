"""Learnability of SynthCXR: a centralized compact DenseNet, macro AUC on a held-out test set per epoch.

Trains MONAI's compact DenseNet (the `densenet_compact` architecture, 0.17M parameters) on
20,000 SynthCXR images (seed 0) with Adam 1e-3, batch 64, BCE, and scores 4,000 images of another
seed after every epoch. Target: macro AUC >= 0.85 within a few epochs.

    .venv/bin/python benchmarks/bench_synthcxr_centralized.py [EPOCHS=3] [THREADS=2] [SIZE=32] [N=20000]
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

from fedweigh.data.base import CHEST_FINDINGS
from fedweigh.data.synthcxr import generate_synthcxr
from fedweigh.models import build_model


def main() -> None:
    epochs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    size = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 20000
    t0 = time.time()
    train, test = generate_synthcxr(n, size, seed=0), generate_synthcxr(4000, size, seed=1)
    print(f"generated {n} + 4000 images in {time.time() - t0:.1f} s", flush=True)
    net = build_model("densenet_compact", num_classes=14, img_size=size, seed=0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    x, y = torch.from_numpy(train.images), torch.from_numpy(train.labels)
    xt, yt = torch.from_numpy(test.images), test.labels
    g = torch.Generator().manual_seed(0)
    t1 = time.time()
    for epoch in range(epochs):
        net.train()
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), 64):
            b = perm[i : i + 64]
            opt.zero_grad()
            loss_fn(net(x[b]), y[b]).backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            p = np.concatenate([torch.sigmoid(net(xt[i : i + 500])).numpy() for i in range(0, len(xt), 500)])
        aucs = {
            c: roc_auc_score(yt[:, k], p[:, k])
            for k, c in enumerate(CHEST_FINDINGS)
            if 0 < yt[:, k].sum() < len(yt)
        }
        print(
            f"epoch {epoch + 1}: macro AUC {np.mean(list(aucs.values())):.4f} ({time.time() - t1:.0f} s)",
            {k: round(v, 3) for k, v in aucs.items()},
            flush=True,
        )


if __name__ == "__main__":
    main()
