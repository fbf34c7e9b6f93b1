"""Attention-rollout heatmaps for the ViT global model (``fedweigh explain``).

Two estimates of which input patches a Vision Transformer's prediction depends on:

* :func:`attention_rollout` (Abnar & Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020):
  per layer ``A_hat = 0.5 * A + 0.5 * I`` (the residual connection), rows re-normalised to sum to 1;
  the rollout is the product ``R = A_hat_L @ ... @ A_hat_1``. ``R[i, j]`` estimates how much of token
  ``i``'s output at the last layer flows from input token ``j``.
* :func:`gradient_attention_rollout`: class-specific rollout. Each layer's attention is weighted by its
  gradient with respect to the target logit and only the positive part is kept, averaged over heads,
  ``A_bar = mean_h (dy_c/dA ⊙ A)^+`` (Chefer, Gur & Wolf, "Generic Attention-model Explainability for
  Interpreting Bi-Modal and Encoder-Decoder Transformers", ICCV 2021; the "grad rollout" of
  jacobgil/vit-explain), then rolled out as above. The [CLS] row of ``R`` (or, for a model without a
  class token, the mean over rows) is the relevance of each patch; it is reshaped to the patch grid,
  up-sampled bilinearly to the image size and min-max normalised to [0, 1] per image.

Attention matrices are read with forward hooks on the ``drop_weights`` module of every MONAI
``SABlock`` (its input is the post-softmax attention, shape (B, heads, T, T)); the model is not changed.
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from fedweigh.arrays import to_numpy

if TYPE_CHECKING:  # torch and MONAI are imported where used, so the CLI's parser stays fast to build
    import torch
    from torch import Tensor, nn

    from fedweigh.data.base import LabeledImages
    from fedweigh.models import FedweighNet

HeadFusion = Literal["mean", "max", "min"]
HEAD_FUSIONS: tuple[str, ...] = ("mean", "max", "min")

#: Prefixes that wrappers add to state-dict keys (Opacus' GradSampleModule, DataParallel / DDP).
_WRAPPER_PREFIXES: tuple[str, ...] = ("_module.", "module.")

#: Characters per line of the true-findings panel title.
_TITLE_WIDTH = 34


# ---------------------------------------------------------------------------------------------- rollout


def _fuse_heads(attention: Tensor, head_fusion: str) -> Tensor:
    """(B, heads, T, T) -> (B, T, T) by mean / max / min over heads; (B, T, T) is returned as is."""
    if attention.ndim == 3:
        return attention
    if attention.ndim != 4:
        raise ValueError(
            f"attention must have shape (B, heads, T, T) or (B, T, T), got {tuple(attention.shape)}"
        )
    if head_fusion == "mean":
        return attention.mean(dim=1)
    if head_fusion == "max":
        return attention.amax(dim=1)
    if head_fusion == "min":
        return attention.amin(dim=1)
    raise ValueError(f"unknown head_fusion {head_fusion!r}; expected one of {HEAD_FUSIONS}")


def _discard_lowest(attention: Tensor, discard_ratio: float) -> Tensor:
    """Zero the lowest ``discard_ratio`` fraction of each sample's (T, T) entries, never entry (0, 0).

    As in jacobgil/vit-explain: dropping weak attention links sharpens the rollout.
    """
    import torch

    if discard_ratio <= 0.0:
        return attention
    b, t, _ = attention.shape
    flat = attention.reshape(b, t * t).clone()
    k = int(t * t * discard_ratio)
    if k == 0:
        return attention
    lowest = flat.topk(k, dim=-1, largest=False).indices
    keep_cls = lowest == 0
    values = torch.where(keep_cls, flat.gather(1, lowest), torch.zeros_like(lowest, dtype=flat.dtype))
    flat.scatter_(1, lowest, values)
    return flat.reshape(b, t, t)


def attention_rollout(
    attentions: Sequence[Tensor], discard_ratio: float = 0.0, head_fusion: HeadFusion = "mean"
) -> Tensor:
    """Attention rollout (Abnar & Zuidema, ACL 2020) over the layers, first layer first.

    Each layer's attention (B, heads, T, T) (or already fused (B, T, T), non-negative) is fused over
    heads (``head_fusion``), optionally thinned (``discard_ratio``: the lowest fraction of entries set to
    0, never the [CLS]->[CLS] entry), mixed with the residual path ``A_hat = 0.5 A + 0.5 I`` and
    row-normalised; the result is ``R = A_hat_L @ ... @ A_hat_1`` of shape (B, T, T), computed in
    float64 (every row of ``R`` sums to 1).
    """
    import torch

    if not attentions:
        raise ValueError("attention_rollout: no attention matrices given")
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"attention_rollout: discard_ratio must be in [0, 1), got {discard_ratio}")
    result: Tensor | None = None
    for layer, attention in enumerate(attentions):
        fused = _fuse_heads(attention.detach().to(torch.float64), head_fusion)
        if fused.shape[-1] != fused.shape[-2]:
            raise ValueError(
                f"attention_rollout: layer {layer} attention is not square: {tuple(fused.shape)}"
            )
        if result is not None and fused.shape != result.shape:
            raise ValueError(
                f"attention_rollout: layer {layer} has shape {tuple(fused.shape)}, earlier layers "
                f"{tuple(result.shape)}"
            )
        fused = _discard_lowest(fused, discard_ratio)
        eye = torch.eye(fused.shape[-1], dtype=fused.dtype, device=fused.device)
        a_hat = 0.5 * fused + 0.5 * eye
        a_hat = a_hat / a_hat.sum(dim=-1, keepdim=True)
        result = a_hat if result is None else a_hat @ result
    assert result is not None
    return result


# ---------------------------------------------------------------------------------------------- hooks


def _attention_dropouts(model: nn.Module) -> list[nn.Module]:
    """The ``drop_weights`` module of every MONAI ``SABlock`` in ``model``, in forward order."""
    from monai.networks.blocks.selfattention import SABlock

    blocks = [m for m in model.modules() if isinstance(m, SABlock)]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no MONAI self-attention block (SABlock); attention rollout "
            "needs a Vision Transformer (FedweighNet(arch='vit'))"
        )
    flash = [i for i, b in enumerate(blocks) if getattr(b, "use_flash_attention", False)]
    if flash:
        raise ValueError(
            f"attention blocks {flash} use flash attention, which never materialises the attention "
            "matrix; build the model with use_flash_attention=False"
        )
    return [b.drop_weights for b in blocks]


def _grid_side(tokens: int) -> tuple[int, bool]:
    """(patch-grid side, has class token) for a sequence of ``tokens`` tokens (g*g or g*g + 1)."""
    side = math.isqrt(tokens)
    if side * side == tokens:
        return side, False
    side = math.isqrt(tokens - 1)
    if side * side == tokens - 1:
        return side, True
    raise ValueError(f"cannot map {tokens} tokens to a square patch grid (with or without a class token)")


def _targets(target_class: int | Sequence[int] | Tensor, batch: int, num_classes: int) -> Tensor:
    """The target class of each of ``batch`` images as an int64 tensor, checked against the model outputs."""
    import torch

    t = torch.as_tensor(target_class, dtype=torch.int64).reshape(-1)
    if t.numel() == 1:
        t = t.expand(batch)
    if t.numel() != batch:
        raise ValueError(f"target_class: {t.numel()} targets for a batch of {batch} images")
    bad = [int(c) for c in t if not 0 <= int(c) < num_classes]
    if bad:
        raise ValueError(f"target_class {bad} out of range for a model with {num_classes} outputs")
    return t


def gradient_attention_rollout(
    model: nn.Module,
    images: Tensor,
    target_class: int | Sequence[int] | Tensor,
    discard_ratio: float = 0.0,
    head_fusion: HeadFusion = "mean",
    use_gradients: bool = True,
) -> np.ndarray:
    """Class-specific relevance heatmaps (B, H, W) in [0, 1] for ``images`` (B, C, H, W).

    With ``use_gradients`` (default) each layer's attention ``A`` (B, heads, T, T) is replaced by
    ``(dy_c/dA ⊙ A)^+`` with ``y_c`` the logit of ``target_class`` (one int, or one per image) before
    head fusion and :func:`attention_rollout` (Chefer et al., ICCV 2021; jacobgil/vit-explain's grad
    rollout); without, plain attention rollout (then ``target_class`` is only validated). The heatmap
    is the [CLS] row of the rollout (the mean over rows when the model has no class token) over the
    patch tokens, reshaped to the patch grid, bilinearly up-sampled to (H, W) and min-max normalised
    per image; a constant map becomes all zeros. The model is run in eval mode; its mode and parameter
    gradients are left unchanged.
    """
    import torch
    import torch.nn.functional as F

    if images.ndim != 4:
        raise ValueError(f"images must have shape (B, C, H, W), got {tuple(images.shape)}")
    dropouts = _attention_dropouts(model)
    captured: list[Tensor] = []

    def hook(_module: nn.Module, inputs: tuple[Tensor, ...], _output: Tensor) -> None:
        captured.append(inputs[0])

    handles = [d.register_forward_hook(hook) for d in dropouts]
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        x = images.detach().to(device=device, dtype=torch.float32).requires_grad_(True)
        with torch.enable_grad():
            logits = model(x)
            if logits.ndim != 2:
                raise ValueError(
                    f"the model returned logits of shape {tuple(logits.shape)}, expected (B, classes)"
                )
            targets = _targets(target_class, logits.shape[0], logits.shape[1]).to(device)
            if len(captured) != len(dropouts):
                raise RuntimeError(
                    f"captured {len(captured)} attention matrices from {len(dropouts)} attention blocks"
                )
            if use_gradients:
                score = logits.gather(1, targets[:, None]).sum()
                grads = torch.autograd.grad(score, captured, allow_unused=True)
                weighted = [
                    (a * (torch.zeros_like(a) if g is None else g)).clamp(min=0)
                    for a, g in zip(captured, grads, strict=True)
                ]
            else:
                weighted = captured
            rollout = attention_rollout(weighted, discard_ratio=discard_ratio, head_fusion=head_fusion)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)

    side, has_cls = _grid_side(rollout.shape[-1])
    relevance = rollout[:, 0, 1:] if has_cls else rollout.mean(dim=1)
    grid = relevance.reshape(-1, 1, side, side).to(torch.float32)
    heat = F.interpolate(grid, size=tuple(images.shape[-2:]), mode="bilinear", align_corners=False)[:, 0]
    lo = heat.amin(dim=(1, 2), keepdim=True)
    span = heat.amax(dim=(1, 2), keepdim=True) - lo
    heat = torch.where(
        span > 0, (heat - lo) / span.clamp(min=torch.finfo(heat.dtype).tiny), torch.zeros_like(heat)
    )
    return to_numpy(heat.clamp(0.0, 1.0))


# ---------------------------------------------------------------------------------------------- figure


def _probabilities(logits: Tensor, task: str) -> np.ndarray:
    """Sigmoid per finding (multilabel) or softmax over classes (multiclass)."""
    import torch

    probs = torch.sigmoid(logits) if task == "multilabel" else torch.softmax(logits, dim=1)
    return to_numpy(probs)


def _true_names(labels: np.ndarray, task: str, class_names: Sequence[str]) -> str:
    if task == "multiclass":
        return str(class_names[int(labels)])
    positive = [
        class_names[k] for k in range(len(class_names)) if np.isfinite(labels[k]) and labels[k] >= 0.5
    ]
    return ", ".join(positive) if positive else "no finding"


def explain_grid(
    model: nn.Module,
    data: LabeledImages,
    indices: Sequence[int],
    class_names: Sequence[str] | None = None,
    out_path: str | Path = "explain.png",
    target: Literal["predicted"] | int = "predicted",
    discard_ratio: float = 0.0,
    top_k: int = 3,
    images_per_row: int = 4,
    dpi: int = 90,
) -> Path:
    """Write a PNG grid: per image its input and the gradient-rollout heatmap overlaid on it.

    ``target="predicted"`` explains each image's most probable class (finding); an int explains that
    class for every image. Panel titles give the true findings and the ``top_k`` predictions with their
    probabilities (sigmoid for multi-label data, softmax for multi-class). Drawn with matplotlib's Agg
    canvas (no display needed); pixels are drawn unsmoothed, which keeps the PNG at about 15 KB per
    image at the defaults.
    """
    import torch
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = tuple(class_names) if class_names is not None else data.class_names
    if len(names) != data.num_classes:
        raise ValueError(f"explain_grid: {len(names)} class names for data with {data.num_classes} classes")
    rows = [int(i) for i in indices]
    if not rows:
        raise ValueError("explain_grid: no image indices given")
    out_of_range = [i for i in rows if not 0 <= i < len(data)]
    if out_of_range:
        raise IndexError(f"explain_grid: indices {out_of_range} out of range for {len(data)} images")

    device = next(model.parameters()).device
    images = torch.from_numpy(np.ascontiguousarray(data.images[rows])).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(images)
    finally:
        model.train(was_training)
    if logits.shape[1] != len(names):
        raise ValueError(
            f"explain_grid: the model has {logits.shape[1]} outputs but there are {len(names)} classes"
        )
    probs = _probabilities(logits, data.task)
    if target == "predicted":
        targets = probs.argmax(axis=1)
    elif isinstance(target, int | np.integer) and 0 <= int(target) < len(names):
        targets = np.full(len(rows), int(target))
    else:
        raise ValueError(
            f"explain_grid: target must be 'predicted' or a class index in [0, {len(names)}), got {target!r}"
        )
    heat = gradient_attention_rollout(model, images, torch.from_numpy(targets), discard_ratio=discard_ratio)

    per_row = max(1, min(images_per_row, len(rows)))
    n_rows = math.ceil(len(rows) / per_row)
    fig = Figure(figsize=(2.2 * 2 * per_row, 3.3 * n_rows))
    FigureCanvasAgg(fig)
    axes = fig.subplots(n_rows, 2 * per_row, squeeze=False)
    for ax in axes.ravel():
        ax.axis("off")
    for j, row in enumerate(rows):
        r, c = divmod(j, per_row)
        gray = data.images[row].mean(axis=0)
        top = np.argsort(-probs[j])[:top_k]
        pred = "\n".join(f"{names[k]} {probs[j, k]:.2f}" for k in top)
        truth = textwrap.fill(_true_names(data.labels[row], data.task, names), width=_TITLE_WIDTH)
        ax_in, ax_heat = axes[r, 2 * c], axes[r, 2 * c + 1]
        ax_in.imshow(gray, cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
        ax_in.set_title(f"#{row} true:\n{truth}", fontsize=7)
        ax_heat.imshow(gray, cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
        # The heatmap is already up-sampled to the image grid: show its pixels as they are.
        ax_heat.imshow(heat[j], cmap="jet", alpha=0.45, vmin=0.0, vmax=1.0, interpolation="nearest")
        ax_heat.set_title(f"heatmap for: {names[int(targets[j])]}\n{pred}", fontsize=7)
    fig.tight_layout()
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, format="png")
    return path


# ---------------------------------------------------------------------------------------------- checkpoint


def _strip_wrapper_prefix(key: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def _sample(keys: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(list(keys)[:limit])
    return f"{shown}, ... ({len(keys)} in all)" if len(keys) > limit else shown


def load_global_model(
    path: str | Path,
    arch: str = "vit",
    num_classes: int = 14,
    img_size: int = 32,
    in_channels: int = 1,
    norm: str = "batch",
    map_location: str | torch.device = "cpu",
) -> FedweighNet:
    """A :class:`FedweighNet` with the weights of an NVFlare PyTorch persistor checkpoint.

    ``path`` is e.g. the server's ``FL_global_model.pt``: a dict ``{"model": state_dict, ...}`` as
    NVFlare's ``PTFileModelPersistor`` writes it, or a raw state dict;
    ``_module.`` / ``module.`` prefixes (Opacus, DDP) are stripped. Loaded with ``weights_only=True``.
    Raises ``FileNotFoundError`` / ``ValueError`` naming the file when it is missing, unreadable, or its
    keys or shapes do not match the model built from (arch, num_classes, img_size, in_channels, norm).
    """
    import torch

    from fedweigh.models import FedweighNet

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model checkpoint not found: {path}")
    try:
        data = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # unpickling errors come in many types
        raise ValueError(f"{path}: cannot read a PyTorch checkpoint ({type(err).__name__}: {err})") from err
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        state = data["model"]
    elif isinstance(data, dict):
        state = data
    else:
        raise ValueError(
            f"{path}: expected a state dict or a dict with a 'model' state dict, got {type(data).__name__}"
        )
    weights: dict[str, Tensor] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor")
        weights[_strip_wrapper_prefix(str(key))] = value

    model = FedweighNet(
        arch=arch, num_classes=num_classes, in_channels=in_channels, img_size=img_size, norm=norm
    )
    expected = model.state_dict()
    missing = [k for k in expected if k not in weights]
    unexpected = [k for k in weights if k not in expected]
    mismatched = [
        f"{k} {tuple(weights[k].shape)} vs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in weights and weights[k].shape != v.shape
    ]
    if missing or unexpected or mismatched:
        problems = []
        if missing:
            problems.append(f"missing keys: {_sample(missing)}")
        if unexpected:
            problems.append(f"unexpected keys: {_sample(unexpected)}")
        if mismatched:
            problems.append(f"shape mismatches (checkpoint vs model): {_sample(mismatched)}")
        hint = ""
        head = weights.get("net.head.weight")
        if head is not None and head.ndim == 2 and head.shape[0] != num_classes:
            hint = f"; the checkpoint's head has {head.shape[0]} outputs (use num_classes={head.shape[0]})"
        raise ValueError(
            f"{path}: checkpoint does not match FedweighNet(arch={arch!r}, num_classes={num_classes}, "
            f"img_size={img_size}, in_channels={in_channels}): " + "; ".join(problems) + hint
        )
    model.load_state_dict(weights)
    return model.to(map_location).eval()


# ---------------------------------------------------------------------------------------------- CLI


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
