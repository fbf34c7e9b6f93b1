"""The client script's arguments (a job's ``train_args``): :class:`ClientArgs` and its command line."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass, field

from fedweigh.checks import check_client_args

logger = logging.getLogger("fedweigh.site")

__all__ = ["ClientArgs", "parse_args"]


@dataclass
class ClientArgs:
    """Arguments of the client script (the job's ``train_args``)."""

    dataset: str = "synthcxr"
    scenario: str = "iid-4"
    data_path: str | None = None
    loader_options: dict = field(default_factory=dict)
    size: int = 32
    num_images: int | None = None
    #: Images in the global test set (None: the dataset's own; SynthCXR generates any number,
    #: a loaded dataset can only keep fewer than it has).
    test_images: int | None = None
    seed: int = 0
    arch: str = "densenet_compact"
    norm: str = "batch"
    #: Checkpoint file with the network's weights (fedweigh.models.read_checkpoint); the head is
    #: initialised for the dataset's classes. Read wherever the model is built (server and sites).
    pretrained: str | None = None
    loss: str = "default"
    loss_options: dict = field(default_factory=dict)
    epochs: int = 1
    batch_size: int = 32
    lr: float = 1e-3
    optimizer: str = "adam"
    #: SGD's momentum (unused by Adam).
    momentum: float = 0.9
    #: L2 weight decay of the local optimizer.
    weight_decay: float = 0.0
    max_steps: int | None = None
    threads: int = 0
    eval_test: bool = True
    #: Where the model runs: "auto" (CUDA when present, else CPU), "cpu", "cuda" or "cuda:N".
    device: str = "auto"
    #: channels_last memory format for the convolutions (faster on CPU and GPU; same values up to
    #: floating-point summation order).
    channels_last: bool = True
    #: Keep the local optimizer (e.g. Adam's moments) across rounds instead of a fresh one per round.
    keep_optimizer: bool = False
    #: bf16 autocast for forward and loss on CUDA (ignored on CPU).
    amp: bool = False
    #: torch.compile the model for training (pays a one-off compilation, amortised over long runs).
    compile: bool = False
    #: Light label-preserving augmentation of the training batches (fedweigh.train.augment_batch:
    #: shifts up to 1/16 of the side, intensity scale and offset; no flips). Not with DP-SGD.
    augment: bool = False
    #: DP-SGD (fedweigh.secure.dp_config.DPConfig): on when dp_epsilon (total over the job) or dp_noise_multiplier is set.
    dp_epsilon: float | None = None
    dp_delta: float = 1e-5
    dp_max_grad_norm: float = 1.0
    dp_noise_multiplier: float | None = None
    dp_accountant: str = "rdp"
    dp_mode: str = "auto"
    #: Gaussian noise on the label statistics (fedweigh.secure.dp_config.StatsDPConfig): on when stats_dp_epsilon is set.
    stats_dp_epsilon: float | None = None
    stats_dp_delta: float = 1e-5

    def __post_init__(self) -> None:
        # DP-SGD needs per-sample gradients, which BatchNorm mixes across samples: with DP on, the
        # DenseNets use GroupNorm, and since the job's global model is built from these arguments too,
        # server and sites agree on the architecture.
        dp_on = self.dp_epsilon is not None or self.dp_noise_multiplier is not None
        if dp_on and self.norm == "batch" and self.arch != "vit":  # the ViT always uses LayerNorm
            logger.info("DP-SGD is on: using norm='group' instead of 'batch' (Opacus-compatible)")
            self.norm = "group"
        histogram_loss = not (self.loss in ("default", "bce", "ce") and not self.loss_options)
        if dp_on and histogram_loss and self.stats_dp_epsilon is None:
            raise ValueError(
                f"loss {self.loss!r} is built from the site's label histogram; under DP-SGD it may only use the "
                "privatised histogram: set stats_dp_epsilon as well (e.g. 1.0)"
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


def parse_args(argv: list[str] | None = None) -> ClientArgs:
    defaults = ClientArgs()
    p = argparse.ArgumentParser(description="fedweigh NVFlare client")
    p.add_argument("--dataset", default=defaults.dataset)
    p.add_argument("--scenario", default=defaults.scenario)
    p.add_argument("--data-path", default=None)
    p.add_argument(
        "--loader-options",
        type=json.loads,
        default={},
        help='JSON, e.g. {"uncertainty": "zeros"} for CheXpert',
    )
    p.add_argument("--size", type=int, default=defaults.size)
    p.add_argument("--num-images", type=int, default=None)
    p.add_argument("--test-images", type=int, default=None, help="images in the global test set")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--arch", default=defaults.arch)
    p.add_argument("--norm", default=defaults.norm)
    p.add_argument("--pretrained", default=None, help="checkpoint file with the network's weights")
    p.add_argument("--loss", default=defaults.loss)
    p.add_argument("--loss-options", type=json.loads, default={})
    p.add_argument("--epochs", type=int, default=defaults.epochs)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--optimizer", default=defaults.optimizer)
    p.add_argument("--momentum", type=float, default=defaults.momentum, help="SGD's momentum")
    p.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--threads", type=int, default=defaults.threads, help="torch threads; 0 = automatic")
    p.add_argument("--eval-test", action=argparse.BooleanOptionalAction, default=defaults.eval_test)
    p.add_argument("--device", default=defaults.device, help="auto (CUDA when present), cpu, cuda, cuda:N")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=defaults.channels_last)
    p.add_argument("--keep-optimizer", action=argparse.BooleanOptionalAction, default=defaults.keep_optimizer)
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=defaults.amp)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=defaults.compile)
    p.add_argument(
        "--augment",
        action=argparse.BooleanOptionalAction,
        default=defaults.augment,
        help="shift and intensity augmentation of the training batches",
    )
    p.add_argument(
        "--dp-epsilon", type=float, default=None, help="DP-SGD: total epsilon over the job's rounds"
    )
    p.add_argument("--dp-delta", type=float, default=defaults.dp_delta)
    p.add_argument("--dp-max-grad-norm", type=float, default=defaults.dp_max_grad_norm)
    p.add_argument(
        "--dp-noise-multiplier", type=float, default=None, help="DP-SGD: fixed sigma instead of epsilon"
    )
    p.add_argument("--dp-accountant", default=defaults.dp_accountant, choices=("rdp", "prv"))
    p.add_argument(
        "--dp-mode", default=defaults.dp_mode, choices=("auto", "fast", "hooks", "functorch", "ghost")
    )
    p.add_argument(
        "--stats-dp-epsilon", type=float, default=None, help="Gaussian noise on the label statistics"
    )
    p.add_argument("--stats-dp-delta", type=float, default=defaults.stats_dp_delta)
    ns = p.parse_args(argv)
    return check_client_args(ClientArgs(**vars(ns)), "client script arguments")
