"""Models by architecture name: :func:`build_model`, the DP-SGD-ready copy of a model
(:func:`make_opacus_compatible`) and the count of trainable parameters."""

from __future__ import annotations

from torch import nn

from fedweigh.models.base import FedweighNet

__all__ = ["build_model", "count_parameters", "make_opacus_compatible"]


def build_model(
    arch: str,
    num_classes: int,
    in_channels: int = 1,
    img_size: int = 32,
    norm: str = "batch",
    save_attn: bool = False,
    seed: int | None = None,
    pretrained: str | None = None,
) -> FedweighNet:
    """The :class:`FedweighNet` of architecture ``arch``: random initial weights (from ``seed`` when
    given, else the global RNG), or the network's from the ``pretrained`` checkpoint file with a
    freshly initialised head."""
    return FedweighNet(
        arch=arch,
        num_classes=num_classes,
        in_channels=in_channels,
        img_size=img_size,
        norm=norm,
        save_attn=save_attn,
        seed=seed,
        pretrained=pretrained,
    )


def make_opacus_compatible(model: nn.Module) -> nn.Module:
    """A copy of ``model`` that Opacus' ``ModuleValidator`` accepts (no BatchNorm).

    A :class:`FedweighNet` with ``norm="batch"`` is rebuilt with ``norm="group"`` (so its stored
    constructor arguments stay true) and keeps every tensor whose name and shape still match
    (convolutions, linear layers, normalisation affine weights); BatchNorm running statistics are
    dropped. Any other module goes through ``opacus.validators.ModuleValidator.fix``.
    Raises ``ValueError`` listing what Opacus still rejects.
    """
    from opacus.validators import ModuleValidator

    if isinstance(model, FedweighNet):
        regroup = model.norm == "batch" and model.arch != "vit"
        fixed = FedweighNet(
            arch=model.arch,
            num_classes=model.num_classes,
            in_channels=model.in_channels,
            img_size=model.img_size,
            norm="group" if regroup else model.norm,
            save_attn=model.save_attn,
            pretrained=model.pretrained,
        )
        if regroup:
            target = fixed.state_dict()
            kept = {k: v for k, v in model.state_dict().items() if k in target and v.shape == target[k].shape}
            fixed.load_state_dict(kept, strict=False)
        else:
            fixed.load_state_dict(model.state_dict())
        fixed.to(next(model.parameters()).device)
    else:
        fixed = ModuleValidator.fix(model)
    errors = ModuleValidator.validate(fixed, strict=False)
    if errors:
        raise ValueError(f"make_opacus_compatible: Opacus still rejects the model: {errors}")
    return fixed


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
