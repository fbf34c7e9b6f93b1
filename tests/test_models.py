"""Models by architecture: shapes, the thin class per architecture, stored constructor arguments, norm
variants and Opacus compatibility."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from opacus.validators import ModuleValidator
from torch import nn

from fedweigh.models import (
    ARCHITECTURES,
    FedweighNet,
    build_model,
    count_parameters,
    densenet_min_input_size,
    make_opacus_compatible,
    vit_patch_size,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def models() -> dict[str, FedweighNet]:
    torch.manual_seed(0)
    return {arch: build_model(arch, num_classes=5).eval() for arch in ARCHITECTURES}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_forward_shape_at_32px(models: dict[str, FedweighNet], arch: str) -> None:
    with torch.no_grad():
        out = models[arch](torch.rand(2, 1, 32, 32))
    assert out.shape == (2, 5)
    assert torch.isfinite(out).all()


def test_densenet121_upsamples_28px_input(models: dict[str, FedweighNet]) -> None:
    net = models["densenet121"]
    assert net.min_input_size == 32
    x = torch.rand(2, 1, 28, 28)
    with torch.no_grad():
        out = net(x)
        ref = net(F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False))
    assert out.shape == (2, 5)
    torch.testing.assert_close(out, ref)


def test_densenet_min_input_size_formula() -> None:
    assert densenet_min_input_size(4, "batch") == 32  # DenseNet121: 32 px -> 1x1 last feature map
    assert densenet_min_input_size(4, "instance") == 64
    assert densenet_min_input_size(3, "batch") == 16
    # instance norm needs a 2x2 last map: 32 px trains, 28 px input gets upsampled instead of failing
    net = build_model("densenet_compact", 3, norm="instance").train()
    assert net(torch.rand(2, 1, 28, 28)).shape == (2, 3)


def test_vit_resizes_other_sizes_and_keeps_attention() -> None:
    torch.manual_seed(0)
    net = build_model("vit", 4, img_size=32, save_attn=True).eval()
    assert vit_patch_size(32) == 4 and vit_patch_size(64) == 8
    with torch.no_grad():
        out = net(torch.rand(3, 1, 28, 28))
    assert out.shape == (3, 4)
    att = net.net["blocks"][0].attn.att_mat
    assert att.shape == (3, 3, 65, 65)  # heads, 8x8 patches + class token
    torch.testing.assert_close(att.sum(-1), torch.ones(3, 3, 65))
    vit28 = build_model("vit", 4, img_size=28)
    assert vit28(torch.rand(2, 1, 28, 28)).shape == (2, 4)
    with pytest.raises(ValueError, match="not divisible by the patch size"):
        build_model("vit", 4, img_size=30)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_constructor_args_are_stored_and_recreate_the_model(
    models: dict[str, FedweighNet], arch: str
) -> None:
    net = models[arch]
    params = [p for p in inspect.signature(FedweighNet.__init__).parameters if p != "self"]
    args = {p: getattr(net, p) for p in params}
    assert args == {
        "arch": arch,
        "num_classes": 5,
        "in_channels": 1,
        "img_size": 32,
        "norm": "batch",
        "save_attn": False,
        "seed": None,
        "pretrained": None,
    }
    clone = FedweighNet(**args)
    assert {k: v.shape for k, v in clone.state_dict().items()} == {
        k: v.shape for k, v in net.state_dict().items()
    }


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_no_inplace_activations(models: dict[str, FedweighNet], arch: str) -> None:
    inplace = [name for name, m in models[arch].named_modules() if getattr(m, "inplace", False)]
    assert inplace == []


def test_parameter_counts(models: dict[str, FedweighNet]) -> None:
    assert 100_000 < count_parameters(models["densenet_compact"]) < 400_000
    assert 6_900_000 < count_parameters(models["densenet121"]) < 7_100_000
    assert 800_000 < count_parameters(models["vit"]) < 2_000_000
    frozen = build_model("densenet_compact", 5)
    total = count_parameters(frozen)
    first = next(frozen.parameters())
    first.requires_grad_(False)
    assert count_parameters(frozen) == total - first.numel()


def test_norm_variants() -> None:
    group = build_model("densenet_compact", 3, norm="group")
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in group.modules())
    gns = [m for m in group.modules() if isinstance(m, nn.GroupNorm)]
    assert gns and all(m.num_groups == math.gcd(32, m.num_channels) for m in gns)
    inst = build_model("densenet_compact", 3, norm="instance")
    ins = [m for m in inst.modules() if isinstance(m, nn.InstanceNorm2d)]
    assert ins and all(m.affine and not m.track_running_stats for m in ins)
    for norm_model in (group, inst):
        assert ModuleValidator.validate(norm_model, strict=False) == []


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="unknown arch 'resnet'"):
        FedweighNet(arch="resnet")
    with pytest.raises(ValueError, match="unknown norm 'layer'"):
        FedweighNet(norm="layer")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_make_opacus_compatible(models: dict[str, FedweighNet], arch: str) -> None:
    net = models[arch]
    fixed = make_opacus_compatible(net)
    assert ModuleValidator.validate(fixed, strict=False) == []
    assert isinstance(fixed, FedweighNet) and fixed is not net
    if arch == "vit":
        assert fixed.norm == "batch"  # no BatchNorm to replace; weights copied as they are
        for k, v in net.state_dict().items():
            torch.testing.assert_close(fixed.state_dict()[k], v)
    else:
        assert ModuleValidator.validate(net, strict=False) != []  # BatchNorm is rejected
        assert fixed.norm == "group"
        key = "net.features.conv0.weight"
        torch.testing.assert_close(fixed.state_dict()[key], net.state_dict()[key])


@pytest.mark.parametrize("arch", ["densenet_compact", "vit"])
def test_opacus_per_sample_gradients_are_exact(arch: str) -> None:
    torch.manual_seed(0)
    net = make_opacus_compatible(build_model(arch, 3, img_size=16 if arch == "vit" else 32))
    size = net.img_size
    x = torch.rand(3, 1, size, size)
    gsm = GradSampleModule(net, loss_reduction="sum")
    gsm(x).sum().backward()
    samples = {n[len("_module.") :]: p.grad_sample for n, p in gsm.named_parameters()}
    assert all(g is not None for g in samples.values())
    gsm._close()
    for i in range(3):
        net.zero_grad()
        net(x[i : i + 1]).sum().backward()
        for name, p in net.named_parameters():
            torch.testing.assert_close(samples[name][i], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_seed_makes_initial_weights_reproducible_without_touching_global_rng() -> None:
    import torch

    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = FedweighNet(num_classes=3, seed=7)
    after = torch.rand(1)
    b = FedweighNet(num_classes=3, seed=7)
    c = FedweighNet(num_classes=3, seed=8)
    assert torch.equal(before, after)  # the global random state is untouched
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    assert not torch.equal(
        a.state_dict()["net.class_layers.out.weight"], c.state_dict()["net.class_layers.out.weight"]
    )


@pytest.mark.parametrize("arch", ["densenet_compact", "vit"])
def test_each_architecture_is_a_thin_class_that_fedweighnet_builds_by_name(arch: str) -> None:
    import copy

    cls = ARCHITECTURES[arch]
    assert issubclass(cls, FedweighNet) and cls is not FedweighNet and cls.arch == arch
    by_name = FedweighNet(arch=arch, num_classes=3, seed=1)
    direct = cls(num_classes=3, seed=1)
    assert type(by_name) is cls and type(direct) is cls
    assert by_name.state_dict().keys() == direct.state_dict().keys()
    assert all(torch.equal(by_name.state_dict()[k], v) for k, v in direct.state_dict().items())
    assert type(copy.deepcopy(direct)) is cls  # copies (and pickles) rebuild the architecture's class
    other = next(a for a in ARCHITECTURES if a != arch)
    with pytest.raises(ValueError, match=f"this class builds {arch!r}"):
        cls(arch=other)
