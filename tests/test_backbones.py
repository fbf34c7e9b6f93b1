"""The papers' backbones: pretrained checkpoints, the catalogue's networks per dataset, the bench's --arch."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from monai.networks.nets import DenseNet121, ViT

from fedweigh.bench.cli import add_bench_parser, main_bench
from fedweigh.data.synthcxr import generate_synthcxr
from fedweigh.errors import PretrainedCheckpointError
from fedweigh.flare.jobs import CHESTMNIST_CLIENT, CHEXPERT_CLIENT, JOB_CATALOGUE
from fedweigh.flare.recipes import MethodRecipe, ModelSpec
from fedweigh.models import FedweighNet, read_checkpoint
from fedweigh.site.args import ClientArgs, parse_args
from fedweigh.site.trainer import build_site_model

torch.set_num_threads(1)

#: A tiny MONAI ViT, as a user's own pretraining would save it (two heads of width 64).
TINY_VIT = {"hidden_size": 128, "mlp_dim": 96, "num_layers": 2, "num_heads": 2, "patch_size": 8}


def _monai_vit(num_classes: int = 3, img_size: int = 32, qkv_bias: bool = True) -> ViT:
    torch.manual_seed(11)
    vit = ViT(
        in_channels=1,
        img_size=img_size,
        spatial_dims=2,
        classification=True,
        num_classes=num_classes,
        post_activation=None,
        qkv_bias=qkv_bias,
        dropout_rate=0.0,
        **TINY_VIT,
    ).eval()
    with torch.no_grad():  # MONAI starts the class token and some biases at 0: make every tensor telling
        for p in vit.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return vit


@pytest.fixture(scope="module")
def vit_file(tmp_path_factory) -> tuple[ViT, str]:
    """A MONAI ViT's plain state dict on disk."""
    vit = _monai_vit()
    path = tmp_path_factory.mktemp("ckpt") / "tiny_vit.pt"
    torch.save(vit.state_dict(), path)
    return vit, str(path)


# ------------------------------------------------------------------------------------------ the ViT
def test_monai_vit_checkpoint_gives_the_same_network_with_a_new_head(vit_file) -> None:
    vit, path = vit_file
    net = FedweighNet("vit", num_classes=5, img_size=32, seed=0, pretrained=path).eval()
    assert net.vit_dims == {**TINY_VIT, "in_channels": 1, "qkv_bias": True}
    mine = net.net.state_dict()
    theirs = vit.state_dict()
    torch.testing.assert_close(mine["cls_token.token"], theirs["cls_token"], rtol=0, atol=0)
    for key, value in theirs.items():
        if key.startswith(("classification_head", "cls_token")) or "norm_cross_attn" in key:
            continue
        torch.testing.assert_close(mine[key], value, rtol=0, atol=0, msg=key)
    assert mine["head.weight"].shape == (5, TINY_VIT["hidden_size"])
    # the head is the seeded initialisation, not the checkpoint's
    again = FedweighNet("vit", num_classes=5, img_size=32, seed=0, pretrained=path)
    torch.testing.assert_close(again.net["head"].weight, net.net["head"].weight)
    other_seed = FedweighNet("vit", num_classes=5, img_size=32, seed=1, pretrained=path)
    assert not torch.equal(other_seed.net["head"].weight, net.net["head"].weight)
    torch.testing.assert_close(
        other_seed.net["blocks"][1].mlp.linear2.weight, net.net["blocks"][1].mlp.linear2.weight
    )


def test_with_the_checkpoints_head_it_computes_what_monai_computes(vit_file) -> None:
    """Same logits as the MONAI ViT: the class token, attention heads and block order all carried over."""
    vit, path = vit_file
    net = FedweighNet("vit", num_classes=3, img_size=32, pretrained=path).eval()
    net.net["head"].load_state_dict(
        {k.removeprefix("0."): v for k, v in vit.classification_head.state_dict().items()}
    )
    x = torch.rand(4, 1, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(net(x), vit(x)[0], rtol=1e-5, atol=1e-5)


def test_fedweigh_checkpoint_under_model_key_with_module_prefix(tmp_path) -> None:
    """An NVFlare persistor file ({"model": state dict}) of a DataParallel-wrapped FedweighNet."""
    source = FedweighNet("vit", num_classes=14, img_size=32, seed=3)
    path = tmp_path / "FL_global_model.pt"
    torch.save({"model": {f"module.{k}": v for k, v in source.state_dict().items()}, "train_conf": {}}, path)
    net = FedweighNet("vit", num_classes=2, img_size=32, seed=4, pretrained=str(path))
    for key, value in source.state_dict().items():
        if not key.startswith("net.head."):
            torch.testing.assert_close(net.state_dict()[key], value, rtol=0, atol=0, msg=key)
    assert net.net["head"].weight.shape == (2, 192)


def test_position_embeddings_are_interpolated_to_another_image_size(vit_file) -> None:
    vit, path = vit_file
    net = FedweighNet("vit", num_classes=2, img_size=64, pretrained=path)
    grid = vit.state_dict()["patch_embedding.position_embeddings"].reshape(1, 4, 4, -1).permute(0, 3, 1, 2)
    expected = F.interpolate(grid, size=(8, 8), mode="bicubic", align_corners=False)
    expected = expected.permute(0, 2, 3, 1).reshape(1, 64, -1)
    torch.testing.assert_close(net.net["patch_embedding"].position_embeddings, expected)
    assert net(torch.rand(2, 1, 64, 64)).shape == (2, 2)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda sd: sd.pop("blocks.1.norm2.bias"), r"missing keys \(1\): blocks\.1\.norm2\.bias"),
        (lambda sd: sd.update({"decoder.weight": torch.zeros(2)}), r"unexpected keys \(1\): decoder\.weight"),
        (
            lambda sd: sd.update({"blocks.0.norm1.weight": torch.zeros(64)}),
            r"mismatched shapes.*blocks\.0\.norm1\.weight \(64,\) vs \(128,\)",
        ),
    ],
)
def test_a_checkpoint_that_does_not_fit_names_the_file_and_the_keys(tmp_path, edit, expected) -> None:
    state = _monai_vit().state_dict()
    edit(state)
    path = tmp_path / "bad_vit.pt"
    torch.save(state, path)
    with pytest.raises(PretrainedCheckpointError, match=expected) as info:
        FedweighNet("vit", num_classes=3, img_size=32, pretrained=str(path))
    assert str(path) in str(info.value)


def test_unreadable_checkpoints_name_the_file(tmp_path) -> None:
    missing = tmp_path / "nowhere.pt"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        FedweighNet("vit", pretrained=str(missing))
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint")
    with pytest.raises(PretrainedCheckpointError, match=re.escape(str(text)) + ".*not a PyTorch state dict"):
        read_checkpoint(text)
    optimiser_only = tmp_path / "optim.pt"
    torch.save({"epoch": 3}, optimiser_only)
    with pytest.raises(PretrainedCheckpointError, match="expected a state dict"):
        read_checkpoint(optimiser_only)


def test_image_size_must_be_a_multiple_of_the_checkpoints_patch(vit_file) -> None:
    _, path = vit_file
    with pytest.raises(ValueError, match="img_size 28 is not divisible by the checkpoint .* patch size 8"):
        FedweighNet("vit", img_size=28, pretrained=path)


# ------------------------------------------------------------------------------------ DenseNet121
def _torchvision_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MONAI DenseNet121 key names -> torchvision's (``denselayer1.norm1``, ``classifier``)."""
    out = {}
    for key, value in state.items():
        key = key.replace(".layers.", ".").replace("class_layers.out.", "classifier.")
        out[key] = value
    return out


@pytest.fixture(scope="module")
def rgb_densenet_file(tmp_path_factory) -> tuple[dict[str, torch.Tensor], str]:
    torch.manual_seed(5)
    source = DenseNet121(spatial_dims=2, in_channels=3, out_channels=1000)
    with torch.no_grad():  # running statistics away from their initial 0/1
        for name, buf in source.named_buffers():
            if name.endswith(("running_mean", "running_var")):
                buf.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("ckpt") / "densenet121_rgb.pth"
    torch.save(_torchvision_layout(source.state_dict()), path)
    return source.state_dict(), str(path)


def test_densenet121_from_an_rgb_torchvision_checkpoint(rgb_densenet_file) -> None:
    source, path = rgb_densenet_file
    net = FedweighNet("densenet121", num_classes=14, in_channels=1, img_size=224, pretrained=path)
    mine = net.net.state_dict()
    torch.testing.assert_close(
        mine["features.conv0.weight"], source["features.conv0.weight"].sum(1, keepdim=True)
    )
    for key, value in source.items():
        if key.startswith("class_layers.out.") or key == "features.conv0.weight":
            continue
        torch.testing.assert_close(mine[key], value, rtol=0, atol=0, msg=key)
    assert mine["class_layers.out.weight"].shape == (14, 1024)


def test_densenet121_group_norm_takes_the_affine_weights(rgb_densenet_file) -> None:
    source, path = rgb_densenet_file
    net = FedweighNet("densenet121", num_classes=2, norm="group", pretrained=path)
    norm5 = net.net.features.norm5
    assert isinstance(norm5, torch.nn.GroupNorm)
    torch.testing.assert_close(norm5.weight, source["features.norm5.weight"], rtol=0, atol=0)


def test_densenet121_refuses_a_compact_densenet_checkpoint(tmp_path) -> None:
    path = tmp_path / "compact.pt"
    torch.save(FedweighNet("densenet_compact").state_dict(), path)
    with pytest.raises(
        PretrainedCheckpointError, match=r"compact\.pt.*missing keys \(\d+\): features\."
    ) as info:
        FedweighNet("densenet121", pretrained=str(path))
    message = str(info.value)
    assert "features.denseblock1.denselayer5.layers.conv1.weight" in message  # block 1 has 6 layers, not 4
    assert re.search(
        r"mismatched shapes.*features\.conv0\.weight \(16, 1, 7, 7\) vs \(64, 1, 7, 7\)", message
    )


# --------------------------------------------------------------------- the option through the stack
def test_pretrained_reaches_the_sites_and_the_servers_model(vit_file) -> None:
    vit, path = vit_file
    args = ClientArgs(arch="vit", size=32, pretrained=path, dataset="synthcxr", scenario="iid-4")
    assert parse_args(args.to_argv().split()) == args
    recipe = MethodRecipe(method="dafl", name="dafl_vit", num_rounds=1, min_clients=2, client=args)
    job_model = recipe.model_spec.as_job_model()
    assert job_model["args"]["pretrained"] == path
    server = FedweighNet(**job_model["args"])
    site = build_site_model(replace(args, device="cpu"), generate_synthcxr(8, 32, 0))
    for key, value in server.state_dict().items():  # both start from the checkpoint, head from the seed
        torch.testing.assert_close(site.state_dict()[key].cpu(), value, msg=key)
    torch.testing.assert_close(server.net["norm"].weight, vit.norm.weight)
    # a job without a checkpoint keeps its configuration unchanged
    assert "pretrained" not in ModelSpec().as_job_model()["args"]


def test_catalogue_uses_densenet121_at_224_px_for_real_data_and_the_compact_net_for_synthcxr() -> None:
    """... but for its ViT job (DAFL's paper trains a ViT), at 32 px for a CPU run."""
    for client in (CHESTMNIST_CLIENT, CHEXPERT_CLIENT):
        assert (client.arch, client.size) == ("densenet121", 224)
    for name in ("chestmnist_feddraw", "chexpert_feddraw"):
        spec = JOB_CATALOGUE[name](name).model_spec
        assert (spec.arch, spec.img_size) == ("densenet121", 224)
    synth = [name for name in JOB_CATALOGUE if name.startswith("synthcxr_") and not name.endswith("_vit")]
    assert synth
    for name in synth:
        assert JOB_CATALOGUE[name](name).model_spec.arch == "densenet_compact"
    vit = JOB_CATALOGUE["synthcxr_dafl_vit"]("synthcxr_dafl_vit")
    assert (vit.model_spec.arch, vit.model_spec.img_size) == (
        "vit",
        32,
    ) and vit.server_options.scheme == "dafl"


# ------------------------------------------------------------------------------------------ bench
def _bench(tmp_path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(
        [
            "bench",
            "--out",
            str(tmp_path),
            "--methods",
            "dafl",
            "--scenarios",
            "iid-4",
            "--num-images",
            "48",
            "--rounds",
            "1",
            "--max-steps",
            "1",
            "--jobs",
            "1",
            "--site-workers",
            "1",
            "--no-progress",
            "--device",
            "cpu",
            *extra,
        ]
    )


@pytest.mark.parametrize(
    ("arch", "extra"),
    [("vit", ("--size", "32", "--pretrained")), ("densenet121", ("--size", "32"))],
    ids=["vit-pretrained", "densenet121"],
)
def test_bench_runs_a_method_on_the_network_asked_for(tmp_path, vit_file, arch, extra) -> None:
    _, path = vit_file
    args = _bench(tmp_path, "--arch", arch, *extra, *((path,) if extra[-1] == "--pretrained" else ()))
    assert main_bench(args) == 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["client"]["arch"] == arch and config["client"]["size"] == 32
    assert config["client"]["pretrained"] == (path if arch == "vit" else None)
    assert f"- local training (every method): {arch} " in (tmp_path / "report.md").read_text()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["methods"] == ["dafl"] and 0.0 <= summary["mean_auc"]["dafl"] <= 1.0


def test_bench_refuses_a_missing_checkpoint(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        _bench(tmp_path, "--arch", "vit", "--pretrained", str(tmp_path / "absent.pt"))
    assert "no such checkpoint file" in capsys.readouterr().err


def test_opacus_copy_of_a_pretrained_vit_keeps_its_size_and_weights(vit_file) -> None:
    from fedweigh.models import make_opacus_compatible

    _, path = vit_file
    net = FedweighNet("vit", num_classes=3, img_size=32, pretrained=path)
    fixed = make_opacus_compatible(net)
    assert fixed.vit_dims == net.vit_dims
    for key, value in net.state_dict().items():
        torch.testing.assert_close(fixed.state_dict()[key], value, rtol=0, atol=0, msg=key)


def test_a_checkpoint_changes_the_bench_cells_settings_hash(vit_file) -> None:
    from fedweigh.bench import make_config
    from fedweigh.bench.cells import settings_hash

    _, path = vit_file
    plain = make_config("smoke", "synthcxr", arch="vit", size=32)
    pretrained = make_config("smoke", "synthcxr", arch="vit", size=32, pretrained=path)
    assert settings_hash(plain, "iid-4", "dafl", 0) != settings_hash(pretrained, "iid-4", "dafl", 0)
