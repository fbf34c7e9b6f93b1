"""Per-sample gradients for DP-SGD: per-sample losses, fedweigh's fast layer hooks, the clipping optimizer.

DP-SGD (Abadi et al., CCS 2016) clips each sample's gradient g_i to L2 norm C before summing:
sum_i g_i min(1, C / ||g_i||). That needs per-sample gradients, which autograd does not give
directly. :class:`PerSampleLoss` writes the loss as mean_i l_i with each l_i depending on sample i
only. :class:`FastGradSampler` computes g_i layer by layer from the layer's input a_i and the
gradient of the loss with respect to its output (d l / d out)_i, as Opacus' hooks do (Yousefpour
et al., 2021), e.g. dW_i = G_i U(a_i)^T for a Conv2d with U the im2col unfold, and
dW_i = sum_t g_it a_it^T for a Linear layer; unlike Opacus it does not let autograd also compute the
batch gradient of the weights, which DP-SGD throws away. :func:`dp_optimizer_class` is Opacus'
``DPOptimizer`` with its clipping done once per step. :func:`clipped_mean_gradient` computes the
noise-free clipped gradient (1/B) sum_i clip_C(g_i) with any implementation, for tests and benchmarks.

The rounds, noise and accounting are :mod:`fedweigh.secure.dp_sgd`.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedweigh.secure.dp_config import DP_MODES
from fedweigh.train import MaskedBCEWithLogitsLoss, default_loss

__all__ = ["FastGradSampler", "PerSampleLoss", "clipped_mean_gradient", "dp_optimizer_class"]


class PerSampleLoss(nn.Module):
    """A loss split into per-sample terms l_i, as DP-SGD needs: loss = mean_i l_i (or sum, or the vector).

    l_i is ``loss_fn`` on sample i alone, so no sample's term depends on another sample of the batch.
    For the default losses (masked BCE, cross-entropy) and fedweigh's losses this equals the batch loss
    when no label is unknown; with unknown (NaN) labels the masked mean is taken per sample. The two
    default losses are computed vectorised, any other ``loss_fn`` sample by sample. ``reduction``
    (``"mean"``, ``"sum"``, ``"none"``) is read and set by Opacus' ghost clipping.
    """

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], task: str) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self.task = task
        self.reduction = "mean"
        # the default losses have a closed per-sample form; a weighted or smoothed cross-entropy does not
        self._vectorised = isinstance(loss_fn, MaskedBCEWithLogitsLoss) or (
            type(loss_fn) is nn.CrossEntropyLoss and loss_fn.weight is None and loss_fn.label_smoothing == 0.0
        )

    def per_sample(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The vector (B,) of per-sample losses."""
        if self._vectorised and self.task == "multilabel":
            known = ~torch.isnan(targets)
            terms = F.binary_cross_entropy_with_logits(
                logits, torch.where(known, targets, 0.0), reduction="none"
            )
            return (terms * known).sum(dim=1) / known.sum(dim=1).clamp_min(1)
        if self._vectorised:
            return F.cross_entropy(logits, targets.reshape(-1).long(), reduction="none")
        if logits.shape[0] == 0:
            return logits.sum(dim=1)
        return torch.stack(
            [self.loss_fn(logits[i : i + 1], targets[i : i + 1]) for i in range(logits.shape[0])]
        )

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses = self.per_sample(logits, targets)
        if self.reduction == "none":
            return losses
        if self.reduction == "sum":
            return losses.sum()
        return losses.sum() / max(int(losses.shape[0]), 1)


# ------------------------------------------------------------------------- per-layer per-sample grads
def _conv2d_grad_sample(
    layer: nn.Conv2d, a: torch.Tensor, g: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample grads of a Conv2d: dW_i = G_i U(a_i)^T with U the im2col unfold (B, C_in k k, T).

    The unfold is a strided view (Opacus' ``unfold2d``) for outputs of 64+ positions, ATen's im2col
    for smaller ones, and no unfold at all for 1x1 convolutions (whichever measured fastest on CPU).
    """
    n = a.shape[0]
    grads = g.reshape(n, g.shape[1], -1)
    if layer.kernel_size == (1, 1) and layer.stride == (1, 1) and layer.padding == (0, 0):
        cols = a.reshape(n, a.shape[1], -1)
    elif grads.shape[-1] >= 64:
        from opacus.utils.tensor_utils import unfold2d

        cols = unfold2d(
            a,
            kernel_size=layer.kernel_size,
            padding=layer.padding,
            stride=layer.stride,
            dilation=layer.dilation,
        )
    else:
        cols = F.unfold(
            a, layer.kernel_size, dilation=layer.dilation, padding=layer.padding, stride=layer.stride
        )
    out = {layer.weight: torch.bmm(grads, cols.transpose(1, 2)).view(n, *layer.weight.shape)}
    if layer.bias is not None:
        out[layer.bias] = grads.sum(dim=2)
    return out


def _linear_grad_sample(
    layer: nn.Linear, a: torch.Tensor, g: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample grads of a Linear layer: dW_i = sum_t g_it a_it^T, db_i = sum_t g_it."""
    out = {layer.weight: torch.einsum("n...o,n...i->noi", g, a)}
    if layer.bias is not None:
        out[layer.bias] = g.reshape(g.shape[0], -1, g.shape[-1]).sum(dim=1)
    return out


def _group_norm_grad_sample(
    layer: nn.GroupNorm, a: torch.Tensor, g: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample grads of GroupNorm: dgamma_i = sum_hw x_hat_i g_i, dbeta_i = sum_hw g_i."""
    x_hat = F.group_norm(a, layer.num_groups, eps=layer.eps)
    return {layer.weight: (x_hat * g).flatten(2).sum(dim=2), layer.bias: g.flatten(2).sum(dim=2)}


def _instance_norm_grad_sample(
    layer: nn.InstanceNorm2d, a: torch.Tensor, g: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample grads of an affine InstanceNorm2d (no running statistics)."""
    x_hat = F.instance_norm(a, eps=layer.eps)
    return {layer.weight: (x_hat * g).flatten(2).sum(dim=2), layer.bias: g.flatten(2).sum(dim=2)}


_FAST_SAMPLERS: dict[type, Callable[[Any, torch.Tensor, torch.Tensor], dict[nn.Parameter, torch.Tensor]]] = {
    nn.Conv2d: _conv2d_grad_sample,
    nn.Linear: _linear_grad_sample,
    nn.GroupNorm: _group_norm_grad_sample,
    nn.InstanceNorm2d: _instance_norm_grad_sample,
}


def _fast_unsupported(module: nn.Module) -> str | None:
    """Why :class:`FastGradSampler` cannot handle ``module`` (a module with trainable parameters), or None."""
    kind = type(module)
    if kind not in _FAST_SAMPLERS:
        return f"{kind.__name__} is not among {[k.__name__ for k in _FAST_SAMPLERS]}"
    if isinstance(module, nn.Conv2d) and (
        module.groups != 1 or isinstance(module.padding, str) or module.padding_mode != "zeros"
    ):
        return "Conv2d with groups, string padding or non-zero padding mode"
    if isinstance(module, (nn.GroupNorm, nn.InstanceNorm2d)):
        trainable = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if len(trainable) != 2 or getattr(module, "track_running_stats", False):
            return f"{kind.__name__} without both affine parameters trainable, or with running statistics"
    return None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the incoming gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def dp_optimizer_class() -> type:
    """Opacus' ``DPOptimizer`` with its per-step bookkeeping done once per step rather than per parameter.

    Same clipping, noise and scaling as ``DPOptimizer`` (flat clipping: factor_i = min(1, C / (||g_i|| + 1e-6)),
    summed_grad = sum_i factor_i g_i); Opacus' version re-lists the parameters and their per-sample
    gradients inside its per-parameter loops (quadratic in the number of parameter tensors).
    """
    from opacus.optimizers import DPOptimizer
    from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

    class FastDPOptimizer(DPOptimizer):
        def clip_and_accumulate(self) -> None:
            params = self.params
            grad_samples = [self._get_flat_grad_sample(p) for p in params]
            if len(grad_samples[0]) == 0:
                factor = torch.zeros((0,), device=grad_samples[0].device)
            else:
                norms = torch.stack([gs.reshape(len(gs), -1).norm(2, dim=-1) for gs in grad_samples], dim=1)
                factor = (self.max_grad_norm / (norms.norm(2, dim=1) + 1e-6)).clamp(max=1.0)
            for p, gs in zip(params, grad_samples, strict=True):
                _check_processed_flag(p.grad_sample)
                gs = gs.to(p.dtype)
                grad = torch.tensordot(factor.to(device=gs.device, dtype=p.dtype), gs, dims=1)
                p.summed_grad = grad if p.summed_grad is None else p.summed_grad + grad
                _mark_as_processed(p.grad_sample)

        def scale_grad(self) -> None:
            if self.loss_reduction == "mean":
                denominator = self.expected_batch_size * self.accumulated_iterations
                for p in self.params:
                    p.grad /= denominator

    return FastDPOptimizer


class FastGradSampler:
    """Per-sample gradients for Opacus' ``DPOptimizer`` from forward hooks and output-gradient hooks.

    Each supported layer (Conv2d, Linear, GroupNorm, affine InstanceNorm2d) keeps its input in a
    forward hook and gets d loss / d output from a hook on its output tensor; the per-sample gradient
    is a per-sample product of the two, written to ``p.grad_sample`` (what Opacus' hooks would write).
    Unlike Opacus' hooks it does not let autograd also compute the batch gradient of the weights, which
    DP-SGD throws away: during a training forward pass the parameters are detached from the graph
    (``requires_grad`` off, restored when the forward ends) and the input is made to require a
    gradient instead. ``loss_reduction="mean"`` scales by the batch size, as Opacus does.
    """

    def __init__(self, model: nn.Module, loss_reduction: str = "mean") -> None:
        problems = self.unsupported(model)
        if problems:
            raise ValueError(
                f"FastGradSampler: unsupported layers: {problems}; use an Opacus mode (e.g. 'hooks')"
            )
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(
                f"FastGradSampler: loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}"
            )
        self.model = model
        self.loss_reduction = loss_reduction
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._active = False
        self._forward: dict[str, bool] = {"scaled_at_output": False}
        self._handles = [
            model.register_forward_pre_hook(self._start),
            model.register_forward_hook(self._stop),
        ]
        for module in model.modules():
            if any(p.requires_grad for p in module.parameters(recurse=False)):
                self._handles.append(module.register_forward_hook(self._capture))

    @staticmethod
    def unsupported(model: nn.Module) -> dict[str, str]:
        """``{module name: reason}`` for every layer with trainable parameters the sampler cannot handle."""
        out = {}
        for name, module in model.named_modules():
            if any(p.requires_grad for p in module.parameters(recurse=False)):
                reason = _fast_unsupported(module)
                if reason:
                    out[name or type(module).__name__] = reason
        return out

    def _start(self, module: nn.Module, args: tuple) -> tuple | None:
        if not (module.training and torch.is_grad_enabled()):
            return None
        self._active = True
        self._forward = {"scaled_at_output": False}
        for p in self.params:
            p.grad_sample = None
            p.requires_grad_(False)
        return (args[0].detach().requires_grad_(True), *args[1:])

    def _stop(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not self._active:
            return None
        self._active = False
        for p in self.params:
            p.requires_grad_(True)
        n = args[0].shape[0]
        if n == 0:  # an empty Poisson batch: zero per-sample gradients (Opacus does the same)
            for p in self.params:
                p.grad_sample = torch.zeros((1, *p.shape), dtype=p.dtype, device=p.device)
            return None
        if self.loss_reduction == "mean" and isinstance(output, torch.Tensor):
            # d(mean loss)/d(logits) times B, once at the output, instead of in every layer's hook
            self._forward["scaled_at_output"] = True
            return _ScaleGrad.apply(output, float(n))
        return None

    def _capture(self, layer: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not self._active or args[0].shape[0] == 0:
            return
        activations = args[0].detach()
        sampler = _FAST_SAMPLERS[type(layer)]
        forward = self._forward  # this forward pass's state (scaled at the output or not), read in backward

        def on_grad(grad: torch.Tensor) -> None:
            if self.loss_reduction == "mean" and not forward["scaled_at_output"]:
                grad = grad * grad.shape[0]
            for p, gs in sampler(layer, activations, grad).items():
                prev = getattr(p, "grad_sample", None)
                p.grad_sample = gs if prev is None else prev + gs

        output.register_hook(on_grad)

    def remove(self) -> None:
        """Remove the hooks and the per-sample gradients."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for p in self.params:
            p.requires_grad_(True)
            if hasattr(p, "grad_sample"):
                del p.grad_sample


def clipped_mean_gradient(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    mode: str,
    max_grad_norm: float,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    task: str = "multilabel",
) -> dict[str, torch.Tensor]:
    """The noise-free DP-SGD gradient of one fixed batch, (1/B) sum_i clip_C(g_i), as ``mode`` computes it.

    Works on a copy of ``model``; keys are the model's parameter names. For checking that the
    per-sample gradient implementations (``"fast"`` and Opacus' modes) agree, and for benchmarks.
    """
    if mode not in DP_MODES or mode == "auto":
        raise ValueError(f"clipped_mean_gradient: mode must be one of {DP_MODES[1:]}, got {mode!r}")
    model = copy.deepcopy(model).train()
    criterion: Any = PerSampleLoss(loss_fn if loss_fn is not None else default_loss(task), task)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    n = int(x.shape[0])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*([Ss]ecure RNG|[Ff]ull backward hook).*")
        if mode == "fast":
            sampler = FastGradSampler(model)
            train_model: nn.Module = model
            dp_optimizer = dp_optimizer_class()(
                optimizer, noise_multiplier=0.0, max_grad_norm=max_grad_norm, expected_batch_size=n
            )
        else:
            from opacus import PrivacyEngine

            made = PrivacyEngine(accountant="rdp").make_private(
                module=model,
                optimizer=optimizer,
                data_loader=DataLoader(TensorDataset(x, y), batch_size=n),
                criterion=criterion,
                noise_multiplier=0.0,
                max_grad_norm=max_grad_norm,
                grad_sample_mode=mode,
                poisson_sampling=False,
            )
            train_model, dp_optimizer = made[0], made[1]
            if mode == "ghost":
                criterion = made[2]
        dp_optimizer.zero_grad(set_to_none=True)
        criterion(train_model(x), y).backward()
        dp_optimizer.pre_step()
    if mode == "fast":
        sampler.remove()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
