"""Attention rollout and class-specific gradient rollout of a ViT: the math of ``fedweigh explain``.

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

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np

from fedweigh.arrays import to_numpy

if TYPE_CHECKING:  # torch and MONAI are imported where used, so the CLI's parser stays fast to build
    from torch import Tensor, nn

__all__ = ["HEAD_FUSIONS", "HeadFusion", "attention_rollout", "gradient_attention_rollout"]

HeadFusion = Literal["mean", "max", "min"]
HEAD_FUSIONS: tuple[str, ...] = ("mean", "max", "min")


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
