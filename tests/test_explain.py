"""Attention rollout, gradient rollout heatmaps, the explain figure, checkpoint loading and the CLI."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedweigh.data import generate_synthcxr
from fedweigh.data.base import LabeledImages
from fedweigh.explain import (
    add_explain_parser,
    attention_rollout,
    explain_grid,
    gradient_attention_rollout,
    load_global_model,
)
from fedweigh.models import FedweighNet

torch.set_num_threads(1)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _vit(num_classes: int = 3, img_size: int = 32, seed: int = 0) -> FedweighNet:
    torch.manual_seed(seed)
    return FedweighNet(arch="vit", num_classes=num_classes, img_size=img_size)


# ---------------------------------------------------------------------------------------------- rollout


def test_rollout_of_identity_attention_is_identity() -> None:
    eye = torch.eye(3).expand(2, 4, 3, 3)  # (B, heads, T, T)
    rollout = attention_rollout([eye, eye])
    assert rollout.shape == (2, 3, 3)
    torch.testing.assert_close(rollout, torch.eye(3, dtype=torch.float64).expand(2, 3, 3))


def test_rollout_of_uniform_attention_two_layers() -> None:
    # A_hat = 0.5 U + 0.5 I with U = ones/3; A_hat^2 = 0.25 U + 0.5 U + 0.25 I = 0.75 U + 0.25 I.
    uniform = torch.full((1, 1, 3, 3), 1.0 / 3.0)
    rollout = attention_rollout([uniform, uniform])[0]
    expected = torch.full((3, 3), 0.25, dtype=torch.float64) + 0.25 * torch.eye(3, dtype=torch.float64)
    torch.testing.assert_close(rollout, expected)  # diagonal 0.5, off-diagonal 0.25


def test_rollout_multiplies_later_layers_on_the_left() -> None:
    a1 = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    a2 = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # A_hat1 = [[.5,.5,0],[0,1,0],[0,0,1]], A_hat2 = [[.5,0,.5],[0,1,0],[.5,0,.5]]; R = A_hat2 @ A_hat1.
    rollout = attention_rollout([a1[None], a2[None]])[0]
    expected = torch.tensor([[0.25, 0.25, 0.5], [0.0, 1.0, 0.0], [0.25, 0.25, 0.5]], dtype=torch.float64)
    torch.testing.assert_close(rollout, expected)
    # The opposite order (A_hat1 @ A_hat2) would give a first row [0.25, 0.5, 0.25].
    assert not torch.allclose(attention_rollout([a2[None], a1[None]])[0], expected)


def test_rollout_head_fusion_mean_and_max() -> None:
    heads = torch.stack([torch.eye(3), torch.full((3, 3), 1.0 / 3.0)])[None]  # (1, 2, 3, 3)
    # mean: F = 0.5 I + 0.5 U; A_hat = 0.75 I + 0.25 U -> diagonal 5/6, off-diagonal 1/12.
    mean = attention_rollout([heads], head_fusion="mean")[0]
    torch.testing.assert_close(mean, 0.75 * torch.eye(3, dtype=torch.float64) + 0.25 / 3.0)
    # max: F = diag 1, off 1/3; 0.5 F + 0.5 I = diag 1, off 1/6; rows sum to 4/3 -> diag 0.75, off 0.125.
    top = attention_rollout([heads], head_fusion="max")[0]
    torch.testing.assert_close(top, 0.625 * torch.eye(3, dtype=torch.float64) + 0.125)
    with pytest.raises(ValueError, match="head_fusion"):
        attention_rollout([heads], head_fusion="median")  # type: ignore[arg-type]


def test_rollout_discard_ratio_zeroes_weakest_links_but_not_cls_to_cls() -> None:
    fused = torch.tensor([[[0.1, 0.6, 0.3], [0.2, 0.5, 0.3], [0.05, 0.15, 0.8]]])
    # int(9 * 0.34) = 3 lowest entries: 0.05, 0.1 (the kept [CLS]->[CLS] entry) and 0.15.
    rollout = attention_rollout([fused], discard_ratio=0.34)[0]
    expected = torch.tensor([[0.55, 0.3, 0.15], [0.1, 0.75, 0.15], [0.0, 0.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(rollout, expected)


def test_rollout_rows_sum_to_one_and_bad_inputs_raise() -> None:
    torch.manual_seed(1)
    layers = [torch.softmax(torch.randn(2, 3, 5, 5), dim=-1) for _ in range(4)]
    rollout = attention_rollout(layers, discard_ratio=0.2)
    torch.testing.assert_close(rollout.sum(dim=-1), torch.ones(2, 5, dtype=torch.float64))
    assert (rollout >= 0).all()
    with pytest.raises(ValueError, match="no attention"):
        attention_rollout([])
    with pytest.raises(ValueError, match="discard_ratio"):
        attention_rollout(layers, discard_ratio=1.0)
    with pytest.raises(ValueError, match="layer 1"):
        attention_rollout([layers[0], torch.ones(2, 3, 4, 4)])


# ---------------------------------------------------------------------------------------------- heatmaps


def test_gradient_rollout_shape_range_and_side_effects() -> None:
    model = _vit()
    model.train()
    images = torch.rand(3, 1, 32, 32, generator=torch.Generator().manual_seed(0))
    heat = gradient_attention_rollout(model, images, target_class=2)
    assert isinstance(heat, np.ndarray) and heat.shape == (3, 32, 32)
    assert np.isfinite(heat).all() and heat.min() >= 0.0 and heat.max() <= 1.0
    np.testing.assert_allclose(heat.reshape(3, -1).max(axis=1), 1.0)  # min-max normalised per image
    np.testing.assert_allclose(heat.reshape(3, -1).min(axis=1), 0.0)
    assert model.training, "the model's train/eval mode must be restored"
    assert all(p.grad is None for p in model.parameters()), "parameter gradients must stay untouched"
    plain = gradient_attention_rollout(model, images, target_class=2, use_gradients=False)
    assert plain.shape == (3, 32, 32) and not np.allclose(plain, heat)


def test_gradient_rollout_is_per_image_and_follows_the_input_size() -> None:
    model = _vit()
    images = torch.rand(3, 1, 28, 28, generator=torch.Generator().manual_seed(1))  # the ViT resizes to 32
    heat = gradient_attention_rollout(model, images, target_class=[0, 1, 2])
    assert heat.shape == (3, 28, 28)
    for i in range(3):
        alone = gradient_attention_rollout(model, images[i : i + 1], target_class=i)
        np.testing.assert_allclose(heat[i], alone[0], atol=1e-5)
    other = gradient_attention_rollout(model, images[:1], target_class=1)
    assert not np.allclose(other[0], heat[0]), "the heatmap must depend on the target class"


def test_gradient_rollout_rejects_bad_targets_and_non_vit_models() -> None:
    model = _vit()
    images = torch.rand(2, 1, 32, 32)
    with pytest.raises(ValueError, match="out of range"):
        gradient_attention_rollout(model, images, target_class=3)
    with pytest.raises(ValueError, match="3 targets for a batch of 2"):
        gradient_attention_rollout(model, images, target_class=[0, 1, 2])
    with pytest.raises(ValueError, match="SABlock"):
        gradient_attention_rollout(
            FedweighNet(arch="densenet_compact", num_classes=3), images, target_class=0
        )


# The localisation check: a 16 px ViT (4x4 grid of 4 px patches) learns that a bright patch in the
# bottom-right cell decides the label, while an equally bright distractor patch sits in a random other
# cell of every image. After training, the heatmap of the positive class must peak on the decisive cell
# and be higher there than on the distractor: a map that merely followed brightness would split between
# the two (about half of the images each), so the check fails for such a map.
_SIZE, _PATCH, _GRID = 16, 4, 4
_KEY_CELL = _GRID * _GRID - 1


def _corner_task(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.rand(n, 1, _SIZE, _SIZE, generator=gen) * 0.3
    y = torch.randint(0, 2, (n,), generator=gen)
    distractor = torch.randint(0, _GRID * _GRID - 1, (n,), generator=gen)  # never the key cell
    for i in range(n):
        for cell in [int(distractor[i])] + ([_KEY_CELL] if y[i] == 1 else []):
            r, c = divmod(cell, _GRID)
            x[i, 0, r * _PATCH : (r + 1) * _PATCH, c * _PATCH : (c + 1) * _PATCH] = 0.9
    return x, y, distractor


def _cell_means(heat: np.ndarray) -> np.ndarray:
    return heat.reshape(len(heat), _GRID, _PATCH, _GRID, _PATCH).mean(axis=(2, 4)).reshape(len(heat), -1)


@pytest.fixture(scope="module")
def corner_model() -> FedweighNet:
    gen = torch.Generator().manual_seed(0)
    model = _vit(num_classes=2, img_size=_SIZE, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(100):
        x, y, _ = _corner_task(16, gen)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_heatmap_concentrates_on_the_decisive_region(corner_model) -> None:
    model = corner_model
    x, y, distractor = _corner_task(48, torch.Generator().manual_seed(123))
    with torch.no_grad():
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    assert accuracy >= 0.9, f"the tiny ViT did not learn the task (accuracy {accuracy:.2f})"
    positive = y == 1
    cells = _cell_means(gradient_attention_rollout(model, x[positive], target_class=1))
    others = np.delete(cells, _KEY_CELL, axis=1)
    assert (cells.argmax(axis=1) == _KEY_CELL).mean() >= 0.8
    assert cells[:, _KEY_CELL].mean() > 3.0 * others.mean()
    at_distractor = cells[np.arange(len(cells)), distractor[positive].numpy()]
    assert (cells[:, _KEY_CELL] > at_distractor).mean() >= 0.9


# ---------------------------------------------------------------------------------------------- figure


def _panels(fig) -> list[tuple[object, object]]:
    """(input axis, heatmap axis) per image of an explain grid, in order (empty slots skipped)."""
    axes = fig.axes
    pairs = list(zip(axes[0::2], axes[1::2], strict=True))
    return [(a, h) for a, h in pairs if a.get_images()]


def _expected_heatmaps(model, data, rows, targets) -> np.ndarray:
    images = torch.from_numpy(np.ascontiguousarray(data.images[rows]))
    return gradient_attention_rollout(model, images, torch.as_tensor(targets))


def test_explain_grid_shows_each_image_and_its_rollout_heatmap(tmp_path) -> None:
    from figures import captured_figures

    data = generate_synthcxr(6, 32, seed=0)
    model = _vit(num_classes=14)
    rows = [0, 1, 2, 3, 4]
    with captured_figures() as figures:
        out = explain_grid(model, data, rows, out_path=tmp_path / "figs" / "explain.png")
        fixed = explain_grid(model, data, [5], data.class_names, tmp_path / "one.png", target=2)
    assert out == tmp_path / "figs" / "explain.png"
    assert out.read_bytes()[:8] == PNG_MAGIC and fixed.read_bytes()[:8] == PNG_MAGIC
    assert 1_000 < out.stat().st_size < 300_000

    with torch.no_grad():
        predicted = torch.sigmoid(model.eval()(torch.from_numpy(data.images[rows]))).numpy().argmax(axis=1)
    expected = _expected_heatmaps(model, data, rows, predicted)
    panels = _panels(figures[out])
    assert len(panels) == len(rows)
    for j, (ax_in, ax_heat) in enumerate(panels):
        gray = data.images[rows[j]].mean(axis=0)
        np.testing.assert_array_equal(ax_in.get_images()[0].get_array(), gray)
        assert ax_in.get_title().startswith(f"#{rows[j]} true:")
        background, heat = ax_heat.get_images()
        np.testing.assert_array_equal(background.get_array(), gray)
        np.testing.assert_allclose(heat.get_array(), expected[j], rtol=0, atol=1e-6)
        assert ax_heat.get_title().startswith(f"heatmap for: {data.class_names[predicted[j]]}\n")

    ((_, ax_heat),) = _panels(figures[fixed])
    assert ax_heat.get_title().startswith(f"heatmap for: {data.class_names[2]}\n")
    np.testing.assert_allclose(
        ax_heat.get_images()[1].get_array(), _expected_heatmaps(model, data, [5], [2])[0], atol=1e-6
    )
    with pytest.raises(IndexError, match=r"\[6\]"):
        explain_grid(model, data, [6], out_path=tmp_path / "bad.png")
    with pytest.raises(ValueError, match="target"):
        explain_grid(model, data, [0], out_path=tmp_path / "bad.png", target=14)


def test_explain_grid_multiclass(tmp_path) -> None:
    from figures import captured_figures

    rng = np.random.default_rng(0)
    data = LabeledImages(
        images=rng.random((2, 1, 32, 32), dtype=np.float32),
        labels=np.array([0, 2]),
        class_names=("a", "b", "c"),
        task="multiclass",
    )
    model = _vit(num_classes=3)
    with captured_figures() as figures:
        out = explain_grid(model, data, [0, 1], out_path=tmp_path / "mc.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    with torch.no_grad():
        probs = torch.softmax(model.eval()(torch.from_numpy(data.images)), dim=1).numpy()
    panels = _panels(figures[out])
    for j, (ax_in, ax_heat) in enumerate(panels):
        assert ax_in.get_title() == f"#{j} true:\n{data.class_names[data.labels[j]]}"
        top = int(probs[j].argmax())
        # the title lists the softmax probabilities (they sum to one over the three classes)
        assert f"{data.class_names[top]} {probs[j, top]:.2f}" in ax_heat.get_title()
        np.testing.assert_allclose(
            ax_heat.get_images()[1].get_array(), _expected_heatmaps(model, data, [j], [top])[0], atol=1e-6
        )


# ---------------------------------------------------------------------------------------------- checkpoints


def test_load_global_model_round_trip_persistor_and_raw(tmp_path) -> None:
    model = _vit(num_classes=5, seed=3).eval()
    x = torch.rand(2, 1, 32, 32)
    persistor = tmp_path / "FL_global_model.pt"
    torch.save({"model": model.state_dict(), "train_conf": {"train": {"model": "FedweighNet"}}}, persistor)
    loaded = load_global_model(persistor, num_classes=5)
    assert not loaded.training
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))
    raw = tmp_path / "raw.pt"
    torch.save({f"_module.{k}": v for k, v in model.state_dict().items()}, raw)  # Opacus-wrapped names
    with torch.no_grad():
        torch.testing.assert_close(load_global_model(raw, num_classes=5)(x), model(x))


def test_load_global_model_errors_name_the_file(tmp_path) -> None:
    path = tmp_path / "FL_global_model.pt"
    torch.save({"model": _vit(num_classes=3).state_dict()}, path)
    with pytest.raises(ValueError, match="num_classes=3") as err:
        load_global_model(path, num_classes=14)
    assert str(path) in str(err.value) and "net.head.weight" in str(err.value)
    dense = tmp_path / "dense.pt"
    torch.save(FedweighNet(arch="densenet_compact", num_classes=14).state_dict(), dense)
    with pytest.raises(ValueError, match="holds a FedweighNet of arch='densenet_compact'") as err:
        load_global_model(dense)
    assert str(dense) in str(err.value)
    partial = tmp_path / "partial.pt"
    state = _vit(num_classes=14).state_dict()
    state.pop(next(iter(state)))  # a ViT with one array gone matches no architecture: the keys are listed
    torch.save(state, partial)
    with pytest.raises(ValueError, match="missing keys"):
        load_global_model(partial)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="garbage.pt"):
        load_global_model(garbage)
    with pytest.raises(FileNotFoundError, match="nowhere.pt"):
        load_global_model(tmp_path / "nowhere.pt")
    odd = tmp_path / "odd.pt"
    torch.save({"model": {"net.head.weight": [1, 2]}}, odd)
    with pytest.raises(ValueError, match=r"odd\.pt: entry 'net.head.weight' is a list"):
        load_global_model(odd)


# ---------------------------------------------------------------------------------------------- CLI


def test_importing_the_module_does_not_import_torch() -> None:
    """The CLI builds its parser from this module; torch/MONAI load only when a command runs."""
    code = "import sys, fedweigh.explain; assert 'torch' not in sys.modules and 'monai' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "custom")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fedweigh")
    add_explain_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_untrained_smoke_run_and_checkpoint(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("FEDWEIGH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "explain.png"
    args = _parse(["explain", "--untrained", "--num-images", "10", "--indices", "0", "1", "--out", str(out)])
    assert args.func(args) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert "wrote" in capsys.readouterr().out

    ckpt = tmp_path / "FL_global_model.pt"
    torch.save({"model": _vit(num_classes=14).state_dict()}, ckpt)
    args = _parse(
        ["explain", "--model", str(ckpt), "--num-images", "20", "--target", "effusion", "--out", str(out)]
    )
    assert args.target == "effusion" and args.indices == [0, 1, 2, 3]
    assert args.func(args) == 0


def test_cli_errors_return_2_and_name_the_problem(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("FEDWEIGH_CACHE", str(tmp_path / "cache"))
    args = _parse(["explain", "--num-images", "10", "--out", str(tmp_path / "x.png")])
    assert args.func(args) == 2
    assert "--model" in capsys.readouterr().err
    bad = tmp_path / "FL_global_model.pt"
    torch.save({"model": _vit(num_classes=3).state_dict()}, bad)
    args = _parse(["explain", "--model", str(bad), "--num-images", "10", "--out", str(tmp_path / "x.png")])
    assert args.func(args) == 2
    assert str(bad) in capsys.readouterr().err
    args = _parse(
        ["explain", "--untrained", "--num-images", "10", "--target", "nope", "--out", str(tmp_path / "x.png")]
    )
    assert args.func(args) == 2
    assert "nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse(["explain", "--arch", "densenet_compact"])


def test_a_checkpoint_of_another_architecture_is_named_with_the_one_needed(tmp_path) -> None:
    from fedweigh.explain.checkpoint import load_global_model

    path = tmp_path / "FL_global_model.pt"
    torch.save({"model": FedweighNet(arch="densenet_compact", num_classes=3, img_size=32).state_dict()}, path)
    with pytest.raises(ValueError) as err:
        load_global_model(path, arch="vit", num_classes=3, img_size=32)
    assert str(err.value) == (
        f"{path}: the checkpoint holds a FedweighNet of arch='densenet_compact', and this needs arch='vit': "
        "use a checkpoint of a job trained with arch='vit'"
    )
    # a checkpoint of the right architecture but another head still lists what does not match
    torch.save({"model": _vit(num_classes=5).state_dict()}, path)
    with pytest.raises(ValueError, match="shape mismatches"):
        load_global_model(path, arch="vit", num_classes=3, img_size=32)
