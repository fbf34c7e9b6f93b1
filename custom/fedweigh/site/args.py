"""The client script's arguments (a job's ``train_args``): :class:`ClientArgs`, declared once.

Each option is one field of :class:`ClientArgs`, with its type, default and help (field metadata).
Everything else is derived from those declarations: the client script's command line
(:func:`parse_args`, :meth:`ClientArgs.to_argv`), the local-training settings
(:meth:`ClientArgs.train_config`), the privacy settings (:meth:`ClientArgs.dp_config`,
:meth:`ClientArgs.stats_dp_config`), the options a method may prescribe (``method=True``:
:data:`fedweigh.methods.CLIENT_OPTIONS`) and the flags ``fedweigh bench`` overrides for a whole run
(``bench=True``, :func:`add_client_options`). The values are checked once, by
:func:`fedweigh.checks.check_client_values`; :func:`ineffective_options` names the settings that
would have no effect.
"""

from __future__ import annotations

import argparse
import json
import logging
import typing
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from fedweigh.checks import check_client_args
from fedweigh.secure.dp_config import DPConfig, StatsDPConfig
from fedweigh.train import TrainConfig

logger = logging.getLogger("fedweigh.site")

__all__ = [
    "ClientArgs",
    "add_client_options",
    "bench_options",
    "client_parser",
    "ineffective_options",
    "method_options",
    "parse_args",
]


def _option(
    default: Any = MISSING, *, help: str, method: bool = False, bench: bool = False, factory: Any = MISSING
) -> Any:
    """A :class:`ClientArgs` field: its default (or default ``factory``) and its declaration:
    ``help`` (the command lines' help), ``method`` (a method may prescribe it: local training),
    ``bench`` (``fedweigh bench`` may override it for a whole run)."""
    metadata = {"help": help, "method": method, "bench": bench}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ClientArgs:
    """Arguments of the client script (the job's ``train_args``); each field's help is its metadata."""

    dataset: str = _option("synthcxr", help="dataset of the sites (fedweigh.data.DATASETS)")
    scenario: str = _option("iid-4", help="client-partition scenario (see `fedweigh scenarios`)")
    data_path: str | None = _option(None, help="dataset file or folder (chestmnist, chexpert, images_csv)")
    loader_options: dict = _option(
        factory=dict, help='JSON for the loader, e.g. {"uncertainty": "zeros"} for CheXpert', bench=True
    )
    size: int = _option(32, help="image side in pixels", bench=True)
    num_images: int | None = _option(None, help="images in the pool the sites split", bench=True)
    test_images: int | None = _option(
        None,
        help="images in the global test set (default: the dataset's own; SynthCXR generates any number, "
        "a loaded dataset can only keep fewer than it has)",
        bench=True,
    )
    seed: int = _option(0, help="seed of the data split, the model and the local training")
    arch: str = _option("densenet_compact", help="network (fedweigh.models.ARCHITECTURES)", bench=True)
    norm: str = _option("batch", help="normalisation layers of the DenseNets: batch, group or instance")
    pretrained: str | None = _option(
        None,
        help="checkpoint file with the network's weights (fedweigh.models.read_checkpoint); the head is "
        "initialised for the dataset's classes; read wherever the model is built (server and sites)",
        bench=True,
    )
    loss: str = _option("default", help="client loss (default: the dataset's BCE / CE)")
    loss_options: dict = _option(factory=dict, help='JSON options of the loss, e.g. {"gamma": 2.0}')
    epochs: int = _option(1, help="local epochs per round", method=True)
    batch_size: int = _option(32, help="local batch size", method=True)
    lr: float = _option(1e-3, help="local learning rate", method=True)
    optimizer: str = _option("adam", help="local optimizer (fedweigh.train.OPTIMIZERS)", method=True)
    momentum: float = _option(0.9, help="SGD's momentum (unused by Adam)", method=True)
    weight_decay: float = _option(0.0, help="L2 weight decay of the local optimizer", method=True)
    max_steps: int | None = _option(
        None, help="cap on the local optimizer steps per round", method=True, bench=True
    )
    threads: int = _option(0, help="torch threads; 0 = automatic", bench=True)
    eval_test: bool = _option(True, help="score the global model on the test set too")
    device: str = _option(
        "auto",
        help="where the model runs: auto (CUDA when present, else CPU), cpu, cuda or cuda:N",
        bench=True,
    )
    channels_last: bool = _option(
        True,
        help="channels_last memory format for the convolutions (faster on CPU and GPU; same values up to "
        "floating-point summation order)",
        bench=True,
    )
    keep_optimizer: bool = _option(
        False,
        help="keep the local optimizer (e.g. Adam's moments) across rounds instead of a fresh one per round",
        method=True,
        bench=True,
    )
    amp: bool = _option(
        False, help="bf16 autocast for forward and loss on CUDA (no effect on CPU)", bench=True
    )
    compile: bool = _option(
        False,
        help="torch.compile the model for training (a one-off compilation, amortised over long runs)",
        bench=True,
    )
    augment: bool = _option(
        False,
        help="shift and intensity augmentation of the training batches (fedweigh.train.augment_batch: "
        "shifts up to 1/16 of the side, intensity scale and offset; no flips); not with DP-SGD",
        method=True,
    )
    dp_epsilon: float | None = _option(
        None, help="DP-SGD (fedweigh.secure.dp_config.DPConfig): total epsilon over the job's rounds"
    )
    dp_delta: float = _option(1e-5, help="DP-SGD: delta")
    dp_max_grad_norm: float = _option(1.0, help="DP-SGD: per-sample clipping bound C")
    dp_noise_multiplier: float | None = _option(None, help="DP-SGD: fixed sigma instead of epsilon")
    dp_accountant: str = _option("rdp", help="DP-SGD: privacy accountant (rdp or prv)")
    dp_mode: str = _option("auto", help="DP-SGD: per-sample gradient implementation")
    stats_dp_epsilon: float | None = _option(
        None,
        help="Gaussian noise on the label statistics (fedweigh.secure.dp_config.StatsDPConfig): its epsilon; "
        "unset: each site's policy decides (statistics_epsilon, 1.0 by default; null there: exact statistics)",
    )
    stats_dp_delta: float = _option(
        1e-5, help="statistics DP: delta (also of a site policy's default release)"
    )
    he_precision_bits: int | None = _option(
        None,
        help="fractional bits b every site rounds decrypted CKKS values to, 2^-b (encrypted model updates and "
        "secure statistics; fedweigh.secure.precision): 8 to 20, default 16 for the kits' scale 2^40",
    )

    def __post_init__(self) -> None:
        # DP-SGD needs per-sample gradients, which BatchNorm mixes across samples: with DP on, the
        # DenseNets use GroupNorm, and since the job's global model is built from these arguments too,
        # server and sites agree on the architecture.
        if self.dp_sgd and self.norm == "batch" and self.arch != "vit":  # the ViT always uses LayerNorm
            logger.info("DP-SGD is on: using norm='group' instead of 'batch' (Opacus-compatible)")
            self.norm = "group"
        histogram_loss = not (self.loss in ("default", "bce", "ce") and not self.loss_options)
        if self.dp_sgd and histogram_loss and self.stats_dp_epsilon is None:
            raise ValueError(
                f"loss {self.loss!r} is built from the site's label histogram; under DP-SGD it may only use the "
                "privatised histogram: set stats_dp_epsilon as well (e.g. 1.0)"
            )

    @property
    def dp_sgd(self) -> bool:
        """Whether DP-SGD is on (``dp_epsilon`` or ``dp_noise_multiplier`` set)."""
        return self.dp_epsilon is not None or self.dp_noise_multiplier is not None

    def dp_config(self) -> DPConfig | None:
        """The DP-SGD settings (``dp_*``), or None when DP-SGD is off."""
        if not self.dp_sgd:
            return None
        return DPConfig(
            epsilon=self.dp_epsilon,
            delta=self.dp_delta,
            max_grad_norm=self.dp_max_grad_norm,
            noise_multiplier=self.dp_noise_multiplier,
            accountant=self.dp_accountant,
            mode=self.dp_mode,
        )

    def stats_dp_config(self, site_epsilon: float | None = None) -> StatsDPConfig | None:
        """The statistics-DP settings a site releases its label histogram with, or None (exact).

        The job's ``stats_dp_epsilon`` when set, else ``site_epsilon`` (the site policy's
        ``statistics_epsilon``, :class:`fedweigh.site.policy.SitePolicy`); delta is the job's
        ``stats_dp_delta`` either way. None only when both epsilons are None."""
        epsilon = self.stats_dp_epsilon if self.stats_dp_epsilon is not None else site_epsilon
        if epsilon is None:
            return None
        return StatsDPConfig(epsilon=epsilon, delta=self.stats_dp_delta)

    def train_config(self, *, fedprox_mu: float, seed: int, device: str) -> TrainConfig:
        """The local-training settings of one round (the round's FedProx mu and seed, the resolved device)."""
        return TrainConfig(
            epochs=self.epochs,
            batch_size=self.batch_size,
            lr=self.lr,
            optimizer=self.optimizer,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            max_steps=self.max_steps,
            fedprox_mu=fedprox_mu,
            seed=seed,
            device=device,
            amp=self.amp,
            augment=self.augment,
        )

    def to_argv(self) -> str:
        """The command line that reproduces these arguments (for ``ScriptRunner``)."""
        parts: list[str] = []
        for name, default in ClientArgs().__dict__.items():
            value = getattr(self, name)
            if value == default:
                continue
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                parts.append(flag if value else "--no-" + name.replace("_", "-"))
            elif isinstance(value, dict):
                parts.append(f"{flag} '{json.dumps(value, sort_keys=True)}'")
            else:
                parts.append(f"{flag} {value}")
        return " ".join(parts)


def method_options() -> tuple[str, ...]:
    """The options a method may prescribe (``method=True``: its local training)."""
    return tuple(f.name for f in fields(ClientArgs) if f.metadata["method"])


def bench_options() -> tuple[str, ...]:
    """The options ``fedweigh bench`` overrides for a whole run (``bench=True``)."""
    return tuple(f.name for f in fields(ClientArgs) if f.metadata["bench"])


def _value_type(annotation: Any) -> type:
    """``int`` for ``int`` and ``int | None``, and so on."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def add_client_options(
    parser: argparse.ArgumentParser,
    names: Iterable[str] | None = None,
    *,
    defaults: str = "own",
    help_suffix: str = "",
    extras: dict[str, dict] | None = None,
) -> None:
    """Add the options ``names`` (default: all) of :class:`ClientArgs` to ``parser``, as declared:
    ``--name-with-dashes``, the field's type (``--x/--no-x`` for a flag, JSON for a dict), its help.

    ``defaults="own"``: each option defaults to its field's default; ``"none"``: to None, so that a
    caller can tell what was given (``fedweigh bench`` keeps the profile's value then).
    ``help_suffix`` ends every help; ``extras``: more ``add_argument`` keywords per option (e.g. a
    ``type`` that checks a file), over the declared ones.
    """
    hints = typing.get_type_hints(ClientArgs)
    wanted = None if names is None else set(names)
    for f in fields(ClientArgs):
        if wanted is not None and f.name not in wanted:
            continue
        kind = _value_type(hints[f.name])
        if defaults == "none":
            default = None
        else:
            default = f.default_factory() if f.default_factory is not MISSING else f.default
        spec: dict[str, Any] = {"default": default, "help": f.metadata["help"] + help_suffix}
        if kind is bool:
            spec["action"] = argparse.BooleanOptionalAction
        elif kind is dict:
            spec["type"] = json.loads
        elif kind in (int, float):
            spec["type"] = kind
        spec.update((extras or {}).get(f.name, {}))
        parser.add_argument("--" + f.name.replace("_", "-"), **spec)


def client_parser() -> argparse.ArgumentParser:
    """The client script's command line: one option per :class:`ClientArgs` field."""
    parser = argparse.ArgumentParser(description="fedweigh NVFlare client")
    add_client_options(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> ClientArgs:
    """The client script's :class:`ClientArgs` from its command line (checked: :class:`ConfigError`)."""
    return check_client_args(ClientArgs(**vars(client_parser().parse_args(argv))), "client script arguments")


def ineffective_options(args: ClientArgs, device: str) -> list[str]:
    """Why each setting of ``args`` that would change nothing on ``device`` (the resolved one) has no
    effect; empty when every setting counts."""
    defaults = ClientArgs()
    reasons = []
    if args.dp_sgd and args.keep_optimizer:
        reasons.append("keep_optimizer has no effect under DP-SGD (DP-SGD builds its optimizer every round)")
    if args.dp_sgd and args.compile:
        reasons.append("compile has no effect under DP-SGD (DP-SGD trains the model uncompiled)")
    if args.amp and not str(device).startswith("cuda"):
        reasons.append(f"amp has no effect on device {device!r} (bf16 autocast runs on CUDA only)")
    if args.optimizer != "sgd" and args.momentum != defaults.momentum:
        reasons.append(f"momentum has no effect with optimizer {args.optimizer!r} (SGD's momentum)")
    if not args.dp_sgd:
        changed = [
            name
            for name in ("dp_delta", "dp_max_grad_norm", "dp_accountant", "dp_mode")
            if getattr(args, name) != getattr(defaults, name)
        ]
        if changed:
            reasons.append(
                f"{', '.join(changed)} ha{'ve' if len(changed) > 1 else 's'} no effect: DP-SGD is off"
            )
    return reasons
