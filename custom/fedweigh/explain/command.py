"""``fedweigh explain``: its sub-command parser and what it runs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Literal

from fedweigh.explain.checkpoint import load_global_model
from fedweigh.explain.figure import explain_grid

__all__ = ["add_explain_parser", "main_explain"]


def _parse_target(value: str, class_names: Sequence[str]) -> Literal["predicted"] | int:
    if value == "predicted":
        return "predicted"
    if value.lstrip("-").isdigit():
        return int(value)
    lowered = [n.lower() for n in class_names]
    if value.lower() in lowered:
        return lowered.index(value.lower())
    raise ValueError(
        f"--target {value!r}: expected 'predicted', a class index or one of {', '.join(class_names)}"
    )


def main_explain(args: argparse.Namespace) -> int:
    """``fedweigh explain``: heatmaps of a global ViT on a dataset's test images; 0 on success, 2 on error."""
    import torch

    from fedweigh.data import load_pool
    from fedweigh.models import FedweighNet
    from fedweigh.train import resolve_device

    try:
        if args.model is None and not args.untrained:
            raise ValueError("give --model PATH (e.g. .../FL_global_model.pt) or --untrained for a smoke run")
        pool, test = load_pool(
            args.dataset, args.data_path, size=args.size, seed=args.seed, num_images=args.num_images
        )
        data = test if args.split == "test" else pool
        num_classes = args.num_classes or data.num_classes
        in_channels = int(data.images.shape[1])
        if args.untrained:
            torch.manual_seed(args.seed)
            model = FedweighNet(
                arch=args.arch, num_classes=num_classes, in_channels=in_channels, img_size=args.size
            )
            print(
                "warning: --untrained: random weights, the heatmaps carry no meaning (smoke run)",
                file=sys.stderr,
            )
        else:
            model = load_global_model(
                args.model,
                arch=args.arch,
                num_classes=num_classes,
                img_size=args.size,
                in_channels=in_channels,
            )
        model = model.to(resolve_device(args.device))
        target = _parse_target(args.target, data.class_names)
        out = explain_grid(
            model,
            data,
            args.indices,
            data.class_names,
            args.out,
            target=target,
            discard_ratio=args.discard_ratio,
        )
    except (FileNotFoundError, ValueError, IndexError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    size_kb = out.stat().st_size / 1024
    print(
        f"wrote {out} ({size_kb:.0f} KB): gradient attention rollout of {args.dataset} {args.split} images "
        f"{list(args.indices)}, target {args.target}"
    )
    return 0


def add_explain_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``explain`` sub-command to ``subparsers`` (``set_defaults(func=main_explain)``)."""
    from fedweigh.data import DATASETS

    p = subparsers.add_parser(
        "explain",
        help="gradient attention-rollout heatmaps of a ViT global model on test images (PNG)",
        description=(
            "Heatmaps of the image regions a ViT global model's prediction depends on (gradient-weighted "
            "attention rollout; docs/explain.md). Use the same --dataset, --size, --seed and --num-images "
            "as the training run so that the test split holds the same (unseen) images."
        ),
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--model", help="NVFlare global model checkpoint (FL_global_model.pt) or a state dict"
    )
    source.add_argument("--untrained", action="store_true", help="use a randomly initialised ViT (smoke run)")
    p.add_argument("--dataset", default="synthcxr", choices=DATASETS)
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    p.add_argument("--data-path", default=None, help="dataset file/folder (chestmnist, chexpert)")
    p.add_argument(
        "--num-images", type=int, default=None, help="pool size as in training (default: dataset's)"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="dataset seed as in training (and --untrained weights)"
    )
    p.add_argument("--split", default="test", choices=("test", "pool"))
    p.add_argument(
        "--indices", type=int, nargs="+", default=[0, 1, 2, 3], help="images of the split to explain"
    )
    p.add_argument("--target", default="predicted", help="'predicted', a class index or a class name")
    p.add_argument("--arch", default="vit", choices=("vit",), help="only the ViT has attention to roll out")
    p.add_argument("--size", type=int, default=32, help="image side the model was built for")
    p.add_argument("--num-classes", type=int, default=None, help="model outputs (default: the dataset's)")
    p.add_argument(
        "--discard-ratio", type=float, default=0.0, help="fraction of weakest attention links dropped"
    )
    p.add_argument("--out", default="explain.png", help="output PNG")
    p.set_defaults(func=main_explain)
    return p
