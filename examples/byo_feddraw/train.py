"""The user's own NVFlare Client API script, run under a fedweigh weighting scheme.

Everything here is ordinary Client API code; the one fedweigh call is ``result_meta``, which adds
what the server's scheme weighs a site by (N_k, tau_k and the scalars the scheme asks for;
fedweigh.flare.byo documents the contract). The data are made up per site: sites differ in size
and in class mix, which is where the weighting schemes differ.
"""

from __future__ import annotations

import argparse
import zlib

import nvflare.client as flare
import torch
from model import TinyNet
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from torch import nn

from fedweigh.flare.byo import answer_statistics, global_statistics, is_statistics_task, result_meta

NUM_CLASSES = 4


def site_data(site_name: str, scale: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A site's images and labels: class k is a bright square at corner k; site i has (i + 1) * scale images."""
    index = int("".join(c for c in site_name if c.isdigit()) or 1)
    gen = torch.Generator().manual_seed(zlib.crc32(site_name.encode()))
    n = index * scale
    weights = torch.ones(NUM_CLASSES)
    weights[index % NUM_CLASSES] = 4.0  # each site over-represents one class
    labels = torch.multinomial(weights, n, replacement=True, generator=gen)
    images = 0.3 * torch.randn(n, 1, 16, 16, generator=gen)
    for k in range(NUM_CLASSES):
        r, c = divmod(k, 2)
        images[labels == k, :, r * 8 : r * 8 + 8, c * 8 : c * 8 + 8] += 1.0
    return images, labels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--scale", type=int, default=64)
    args = parser.parse_args()

    flare.init()
    site = flare.get_site_name()
    images, labels = site_data(site, args.scale)
    n_val = max(8, len(labels) // 5)
    train_x, train_y, val_x, val_y = images[n_val:], labels[n_val:], images[:n_val], labels[:n_val]
    class_counts = torch.bincount(train_y, minlength=NUM_CLASSES).tolist()
    model = TinyNet(num_classes=NUM_CLASSES)
    loss_fn = nn.CrossEntropyLoss()

    while flare.is_running():
        received = flare.receive()
        if received is None:
            break
        if is_statistics_task():  # only schemes that need the global label histogram send it
            flare.send(answer_statistics(received, class_counts, len(train_y)))
            continue
        model.load_state_dict({k: torch.as_tensor(v) for k, v in received.params.items()})
        with torch.no_grad():
            val_acc = (model(val_x).argmax(1) == val_y).float().mean().item()
        if flare.get_task_name() != "train":  # evaluation of the global model
            flare.send(FLModel(metrics={"val_accuracy": val_acc}, meta={"num_samples": len(val_y)}))
            continue
        mu = float(received.meta.get("fedweigh_plan", {}).get("fedprox_mu", 0.0))
        anchor = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        steps = 0
        for _ in range(args.epochs):
            for batch in torch.randperm(len(train_y)).split(16):
                optimizer.zero_grad()
                loss = loss_fn(model(train_x[batch]), train_y[batch])
                if mu:
                    loss = loss + mu / 2 * sum(
                        ((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor, strict=True)
                    )
                loss.backward()
                optimizer.step()
                steps += 1
        params = model.state_dict()
        flare.send(
            FLModel(
                params=params,
                params_type=ParamsType.FULL,
                metrics={"val_accuracy": val_acc, "train_loss": float(loss)},
                meta=result_meta(
                    received,
                    num_samples=len(train_y),
                    num_steps=steps,
                    class_counts=class_counts,
                    params=params,
                    global_stats=global_statistics(),  # None unless the scheme ran the statistics phase
                ),
            )
        )


if __name__ == "__main__":
    main()
