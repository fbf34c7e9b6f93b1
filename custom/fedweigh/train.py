"""Local training and evaluation shared by the NVFlare client and the in-process benchmark.

Framework-free (plain PyTorch, no NVFlare) and deterministic for a fixed seed: the same model, data
and :class:`TrainConfig` give bit-identical parameters on the same machine and device.

The pieces compose so that a caller can swap any of them, e.g. for DP-SGD::

    loader = make_loader(data, cfg.batch_size, shuffle=True, seed=cfg.seed)
    optimizer = make_optimizer(model, cfg)
    model, optimizer, loader = privacy_engine.make_private(module=model, optimizer=optimizer, data_loader=loader, ...)
    result = run_epochs(model, loader, optimizer, default_loss(data.task), cfg.epochs, cfg.max_steps)

Parameters travel as a ``state_dict``-shaped ``{name: np.ndarray}`` (:func:`get_params`,
:func:`set_params`), BatchNorm buffers included, which is the format NVFlare exchanges.

Speed (docs/bench.md, "Engine"): :func:`train_local` draws its batches from in-memory tensors
(:class:`TensorBatches`, the same batches in the same order as the DataLoader of :func:`make_loader`,
without its per-sample Python overhead), runs convolutions in the ``channels_last`` memory format
when the model is in it (:func:`to_memory_format`), can keep an optimizer across calls (persistent
client optimizer state), and runs on ``device="auto"`` (CUDA when present) with optional bf16
autocast on CUDA (``amp``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedweigh.arrays import to_numpy
from fedweigh.data.base import LabeledImages
from fedweigh.data.transforms import augment_images
from fedweigh.metrics import evaluate_scores

OPTIMIZERS: tuple[str, ...] = ("adam", "sgd")
#: Device names a model runs on: "auto" resolves to CUDA when present, else CPU.
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
_WRAPPER_PREFIX = "_module."  # Opacus' GradSampleModule (and DPDDP) keep the real model as ``_module``


@dataclass
class TrainConfig:
    """Local training hyper-parameters.

    ``max_steps`` caps the optimizer steps over all epochs (None: no cap). ``fedprox_mu`` > 0 adds
    FedProx's proximal term when global parameters are given. ``augment`` applies
    :func:`augment_batch` to every training batch. ``device`` ("auto", "cpu", "cuda", "cuda:N") is
    resolved by :func:`resolve_device`; ``amp`` runs forward and loss under bf16 autocast on CUDA
    (ignored on CPU).
    """

    epochs: int = 1
    batch_size: int = 32
    lr: float = 1e-3
    optimizer: str = "adam"
    momentum: float = 0.9
    weight_decay: float = 0.0
    fedprox_mu: float = 0.0
    max_steps: int | None = None
    seed: int = 0
    device: str = "cpu"
    augment: bool = False
    amp: bool = False

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"TrainConfig.optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.epochs < 0:
            raise ValueError(f"TrainConfig.epochs must be >= 0, got {self.epochs}")
        if self.batch_size < 1:
            raise ValueError(f"TrainConfig.batch_size must be >= 1, got {self.batch_size}")
        if self.lr <= 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr}")
        if self.fedprox_mu < 0:
            raise ValueError(f"TrainConfig.fedprox_mu must be >= 0, got {self.fedprox_mu}")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"TrainConfig.max_steps must be >= 0 or None, got {self.max_steps}")
        self.device = resolve_device(self.device)


def resolve_device(device: str | torch.device = "auto") -> str:
    """``"auto"`` -> ``"cuda"`` when a CUDA device is present, else ``"cpu"``; other names are checked.

    Raises ValueError for an unknown name, and for a CUDA device on a machine without one.
    """
    name = str(device)
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = name.split(":", 1)[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be one of {DEVICES} (or cuda:N), got {name!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {name!r} asked for, but this machine has no CUDA device; use 'auto' or 'cpu'"
        )
    return name


def to_memory_format(model: nn.Module, channels_last: bool) -> nn.Module:
    """The model with its 4-D weights in the ``channels_last`` memory format (or back to contiguous).

    On CPU, channels_last convolutions of the DenseNets run about 1.3-1.7x faster with one thread;
    the values are the same up to floating-point summation order.
    """
    return model.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def _wants_channels_last(model: nn.Module) -> bool:
    for p in model.parameters():
        if p.dim() == 4:
            return p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous()
    return False


def _format_batch(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last) if channels_last and x.dim() == 4 else x


@dataclass
class TrainResult:
    """What one local training run did: optimizer steps, samples seen, mean data loss per sample."""

    num_steps: int
    num_samples: int
    mean_loss: float


def set_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (all devices) global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _label_tensor(data: LabeledImages) -> torch.Tensor:
    if data.task == "multilabel":
        return torch.as_tensor(np.asarray(data.labels, dtype=np.float32))
    return torch.as_tensor(np.asarray(data.labels, dtype=np.int64))


def make_loader(
    data: LabeledImages, batch_size: int, shuffle: bool, seed: int, drop_last: bool = False
) -> DataLoader:
    """A single-process DataLoader of ``(images float32, labels)`` batches.

    Labels are float32 (N, C) for multi-label (NaN kept for unknown labels) and int64 (N,) for
    multi-class. Shuffling uses its own ``torch.Generator`` seeded with ``seed``, so the order does
    not depend on (nor disturb) the global random state.
    """
    images = torch.as_tensor(np.asarray(data.images, dtype=np.float32))
    dataset = TensorDataset(images, _label_tensor(data))
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        generator=generator,
        num_workers=0,
    )


class TensorBatches:
    """In-memory ``(images, labels)`` batches: the batches :func:`make_loader` yields, in the same order.

    The data are converted to tensors once; each pass draws its order from its own generator exactly
    as ``DataLoader(shuffle=True, generator=...)`` does (one seed draw for the iterator, one
    ``randperm`` per pass, one more when the sampler runs out), so training on it is bit-identical to
    training on the DataLoader, without collating every batch from single samples in Python.
    """

    def __init__(
        self, data: LabeledImages, batch_size: int, shuffle: bool, seed: int, drop_last: bool = False
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.images = torch.as_tensor(np.asarray(data.images, dtype=np.float32))
        self.labels = _label_tensor(data)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        n = len(self.labels)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self):
        n, bs = len(self.labels), self.batch_size
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)  # the DataLoader's base seed
        if self.shuffle:
            order = torch.randperm(n, generator=self.generator)
        else:
            order = torch.arange(n)
        full, rest = divmod(n, bs)
        for i in range(full):
            rows = order[i * bs : (i + 1) * bs]
            yield self.images[rows], self.labels[rows]
        if self.shuffle:  # RandomSampler draws its trailing (empty) remainder when it runs out
            torch.randperm(n, generator=self.generator)
        if rest and not self.drop_last:
            rows = order[full * bs :]
            yield self.images[rows], self.labels[rows]


class MaskedBCEWithLogitsLoss(nn.Module):
    """Binary cross-entropy on logits, averaged over the labelled (non-NaN) entries only.

    loss = sum_{(i,j): y_ij known} BCE(z_ij, y_ij) / #known; 0 (with a gradient path) when none is known.
    NaN targets encode unknown labels (CheXpert U-Ignore).
    """

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        known = ~torch.isnan(targets)
        if not bool(known.any()):
            return logits.sum() * 0.0
        losses = F.binary_cross_entropy_with_logits(
            logits, torch.where(known, targets, 0.0), reduction="none"
        )
        return (losses * known).sum() / known.sum()


def default_loss(task: str) -> nn.Module:
    """Masked BCE-with-logits for ``multilabel``, cross-entropy for ``multiclass``."""
    if task == "multilabel":
        return MaskedBCEWithLogitsLoss()
    if task == "multiclass":
        return nn.CrossEntropyLoss()
    raise ValueError(f"default_loss: task must be 'multilabel' or 'multiclass', got {task!r}")


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Adam or SGD (with ``cfg.momentum``) over the trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def _unwrap(model: nn.Module) -> nn.Module:
    inner = getattr(model, "_module", None)
    return inner if isinstance(inner, nn.Module) else model


def fedprox_term(
    model: nn.Module, global_params: Mapping[str, np.ndarray | torch.Tensor], mu: float
) -> Callable[[], torch.Tensor]:
    """FedProx proximal term (Li et al., MLSys 2020): ``prox() = (mu / 2) * sum_p ||theta_p - theta_g,p||^2``.

    The sum runs over the trainable parameters of ``model``; ``global_params`` is keyed like
    :func:`get_params` (names of an Opacus-wrapped model are matched without the ``_module.`` prefix).
    The global values are copied once, detached, to each parameter's device and dtype.
    """
    anchors: list[tuple[torch.Tensor, torch.Tensor]] = []
    missing: list[str] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        key = name[len(_WRAPPER_PREFIX) :] if name.startswith(_WRAPPER_PREFIX) else name
        if key not in global_params:
            missing.append(key)
            continue
        g = torch.as_tensor(global_params[key]).detach().to(device=p.device, dtype=p.dtype)
        if g.shape != p.shape:
            raise ValueError(
                f"fedprox_term: global parameter {key!r} has shape {tuple(g.shape)}, model {tuple(p.shape)}"
            )
        anchors.append((p, g.clone()))
    if missing:
        raise KeyError(
            f"fedprox_term: global_params lacks {len(missing)} trainable parameter(s): {missing[:10]}"
        )

    def prox() -> torch.Tensor:
        return 0.5 * mu * sum(((p - g) ** 2).sum() for p, g in anchors)

    return prox


def augment_batch(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Light, label-preserving augmentation of a batch in [0, 1] (:func:`fedweigh.data.transforms.augment_images`).

    Per image (:class:`fedweigh.data.transforms.Augmentation` defaults): a shift of up to 1/16 of the
    side (MONAI's ``AffineTransform``, border pixels replicated) and ``x' = clip(a * x + b, 0, 1)``
    with a ~ U(0.9, 1.1), b ~ U(-0.05, 0.05). No flips: left/right matters on chest radiographs.
    Random draws come from ``generator`` (CPU).
    """
    return augment_images(x, generator)


def run_epochs(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    epochs: int,
    max_steps: int | None,
    prox: Callable[[], torch.Tensor] | None = None,
    *,
    device: str | torch.device = "cpu",
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    progress: bool = False,
    amp: bool = False,
) -> TrainResult:
    """The inner training loop: ``epochs`` passes over ``loader``, at most ``max_steps`` steps.

    Each step minimises ``loss_fn(model(x), y) + prox()`` (``prox`` optional, e.g. :func:`fedprox_term`).
    ``transform`` is applied to each image batch on ``device``. The model is put in train mode; the
    reported mean loss is the data loss per sample, without the proximal term. Batches go to the
    model's memory format (channels_last when the model is in it); ``amp`` runs forward and loss
    under bf16 autocast on CUDA.
    """
    model.train()
    channels_last = _wants_channels_last(model)
    autocast = amp and torch.device(device).type == "cuda"
    steps = samples = 0
    loss_sum = 0.0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        try:
            total: int | None = epochs * len(loader)
            if max_steps is not None and total is not None:
                total = min(total, max_steps)
        except TypeError:
            total = max_steps
        bar = tqdm(total=total, desc="train", unit="step", leave=False)
    try:
        for _ in range(epochs):
            if max_steps is not None and steps >= max_steps:
                break
            for x, y in loader:
                if max_steps is not None and steps >= max_steps:
                    break
                x = x.to(device, non_blocking=True)
                y = y.to(device, non_blocking=True)
                if transform is not None:
                    x = transform(x)
                x = _format_batch(x, channels_last)
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=autocast):
                    logits = model(x)
                loss = loss_fn(logits.float(), y)
                total_loss = loss + prox() if prox is not None else loss
                total_loss.backward()
                optimizer.step()
                steps += 1
                n = int(x.shape[0])
                if n:
                    samples += n
                    loss_sum += float(loss.detach()) * n
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{float(loss.detach()):.4f}")
    finally:
        if bar is not None:
            bar.close()
    return TrainResult(
        num_steps=steps, num_samples=samples, mean_loss=loss_sum / samples if samples else float("nan")
    )


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def train_local(
    model: nn.Module,
    data: LabeledImages,
    cfg: TrainConfig,
    loss_fn: nn.Module | Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    global_params: Mapping[str, np.ndarray | torch.Tensor] | None = None,
    progress: bool = False,
    optimizer: torch.optim.Optimizer | None = None,
) -> TrainResult:
    """Train ``model`` in place on ``data`` with ``cfg``; returns steps, samples and mean loss.

    Seeds everything with ``cfg.seed`` first (vary it per round for fresh shuffles). The loss
    defaults to :func:`default_loss`; a custom ``loss_fn(logits, targets)`` gets float targets
    (multi-label, NaN = unknown) or int64 class indices (multi-class). With ``cfg.fedprox_mu > 0``
    and ``global_params`` the FedProx term (mu/2)||theta - theta_g||^2 is added. For a model with
    BatchNorm a final batch of a single sample is dropped (BatchNorm cannot train on it).
    ``optimizer``: an optimizer over ``model``'s parameters kept by the caller across calls (its
    state, e.g. Adam's moments, carries over); None builds a fresh one from ``cfg``.
    """
    set_seed(cfg.seed)
    model.to(cfg.device)
    if len(data) == 0 or cfg.epochs == 0:
        return TrainResult(num_steps=0, num_samples=0, mean_loss=float("nan"))
    drop_last = _has_batchnorm(model) and len(data) > cfg.batch_size and len(data) % cfg.batch_size == 1
    loader = TensorBatches(data, cfg.batch_size, shuffle=True, seed=cfg.seed, drop_last=drop_last)
    optimizer = optimizer if optimizer is not None else make_optimizer(model, cfg)
    prox = None
    if cfg.fedprox_mu > 0 and global_params is not None:
        prox = fedprox_term(model, global_params, cfg.fedprox_mu)
    transform = None
    if cfg.augment:
        aug_gen = torch.Generator().manual_seed(cfg.seed + 1)

        def transform(x: torch.Tensor) -> torch.Tensor:
            return augment_batch(x, aug_gen)

    return run_epochs(
        model,
        loader,
        optimizer,
        loss_fn if loss_fn is not None else default_loss(data.task),
        cfg.epochs,
        cfg.max_steps,
        prox,
        device=cfg.device,
        transform=transform,
        progress=progress,
        amp=cfg.amp,
    )


@torch.no_grad()
def _logits(
    model: nn.Module, data: LabeledImages, batch_size: int, device: str | torch.device | None
) -> torch.Tensor:
    if device is None:  # where the model is
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    was_training = model.training
    channels_last = _wants_channels_last(model)
    model.eval()
    try:
        chunks = []
        for start in range(0, len(data), batch_size):
            x = torch.as_tensor(np.asarray(data.images[start : start + batch_size], dtype=np.float32)).to(
                device
            )
            chunks.append(model(_format_batch(x, channels_last)).float().cpu())
    finally:
        model.train(was_training)
    if not chunks:
        return torch.zeros(0, data.num_classes)
    return torch.cat(chunks)


def _probabilities(task: str, logits: torch.Tensor) -> np.ndarray:
    probs = torch.sigmoid(logits) if task == "multilabel" else torch.softmax(logits, dim=1)
    return to_numpy(probs).astype(np.float32)


@torch.no_grad()
def predict(
    model: nn.Module, data: LabeledImages, batch_size: int = 256, device: str | None = None
) -> np.ndarray:
    """Probabilities (N, C) float32 in eval mode: sigmoid (multi-label) or softmax (multi-class).

    ``device`` None: where the model is."""
    return _probabilities(data.task, _logits(model, data, batch_size, device))


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: LabeledImages,
    batch_size: int = 256,
    device: str | None = None,
    threshold: float | np.ndarray = 0.5,
) -> dict[str, float]:
    """:func:`fedweigh.metrics.evaluate_scores` on ``data`` plus ``loss`` (the default loss, mean)."""
    if len(data) == 0:
        raise ValueError("evaluate: the evaluation set is empty")
    logits = _logits(model, data, batch_size, device)
    metrics = evaluate_scores(
        data.task, data.labels, _probabilities(data.task, logits), data.class_names, threshold
    )
    metrics["loss"] = float(default_loss(data.task)(logits, _label_tensor(data)))
    return metrics


def get_params(model: nn.Module) -> dict[str, np.ndarray]:
    """A copy of the model's ``state_dict`` as NumPy arrays (buffers included, Opacus wrapper removed)."""
    return {k: to_numpy(v).copy() for k, v in _unwrap(model).state_dict().items()}


def set_params(
    model: nn.Module, params: Mapping[str, np.ndarray | torch.Tensor], strict: bool = True
) -> None:
    """Load ``{name: array}`` into the model in place, cast to each entry's dtype and device.

    Raises ``ValueError`` naming every missing key (only when ``strict``), unexpected key and shape
    mismatch. Integer entries (BatchNorm's ``num_batches_tracked``) are rounded, so averaged floats load.
    """
    target = _unwrap(model)
    state = target.state_dict()
    missing = sorted(set(state) - set(params)) if strict else []
    unexpected = sorted(set(params) - set(state))
    converted: dict[str, torch.Tensor] = {}
    mismatched: list[str] = []
    for key, value in params.items():
        if key not in state:
            continue
        tensor = torch.as_tensor(value)
        if tuple(tensor.shape) != tuple(state[key].shape):
            mismatched.append(f"{key}: got {tuple(tensor.shape)}, model has {tuple(state[key].shape)}")
            continue
        ref = state[key]
        if not ref.is_floating_point() and tensor.is_floating_point():
            tensor = tensor.round()
        converted[key] = tensor.to(device=ref.device, dtype=ref.dtype)
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing key(s): {missing[:10]}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected key(s): {unexpected[:10]}")
        if mismatched:
            parts.append(f"{len(mismatched)} shape mismatch(es): {mismatched[:10]}")
        raise ValueError(f"set_params: parameters do not fit {type(target).__name__}: " + "; ".join(parts))
    target.load_state_dict(converted, strict=strict)
