"""DP-SGD for one site across the rounds of a job (Abadi et al., CCS 2016), with Opacus.

Every optimizer step clips each sample's gradient to L2 norm ``max_grad_norm`` (C), sums the
clipped gradients, adds N(0, (sigma C)^2 I) and divides by the expected batch size; batches are
drawn by Poisson sampling with rate q = 1 / ceil(N_k / B). The privacy accountant
(:mod:`fedweigh.secure.accountant`: RDP, Mironov 2017, or PRV, Gopi et al. 2021) turns the history
of (sigma, q, steps) into the epsilon spent. With a target epsilon, sigma is computed once, for the
whole job (rounds x steps per round), so that the planned last round ends at or just under the
target (:func:`opacus.accountants.utils.get_noise_multiplier`). :class:`DPSGD` keeps the accountant
across rounds and, in an NVFlare job, in a JSON file in the client's working directory, so a
relaunched client process continues the same account. Per-sample gradients come from
:mod:`fedweigh.secure.grad_sample` (fedweigh's fast layer hooks, or Opacus' modes; Yousefpour et al.,
2021). FedProx's proximal gradient is added after the noise: it does not depend on the data and
costs no privacy.

Several processes on one accountant file (a relaunched client, a resumed run, two jobs started under
one budget id: the file is named by the budget id) compose their steps into the one history, never
overwrite each other's. Each round is planned and booked under the file's lock
(:func:`fedweigh.secure.accountant.accountant_lock`), with the file re-read inside it:

1. plan: re-read the history; compute the epsilon the round would reach on it; check the job's target
   and the site policy's caps (:class:`fedweigh.site.policy.PrivacyGuard`, which reserves that figure in
   the site's ledger); write the history back with the round's planned steps already in it, so that a
   process planning meanwhile counts them;
2. train, outside the lock;
3. book: re-read the history (the reservation and whatever other processes added), replace the planned
   steps by the steps taken, write it back and record the accountant's epsilon in the ledger.

In the site's privacy ledger (:mod:`fedweigh.site.ledger`) the DP-SGD spend of an accountant file is
one running total, the account ``accountant:<file name>``: the epsilon of the whole composed history
(RDP/PRV composition over every process's steps), overwritten at every round. A resumed run continues
the file and so that one total, and never adds a second copy of the history it continues; jobs of the
budget that spend under other accounts (their label-statistics releases) add to it. Without a file
(in-process runs) the account is the guard's job id and the history is this object's alone.

No NVFlare import: the client script and the in-process benchmark both use this module.
"""

from __future__ import annotations

import logging
import os
import secrets
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedweigh.data.base import LabeledImages
from fedweigh.errors import PrivacyBudgetExhausted
from fedweigh.secure.accountant import (
    AccountantState,
    History,
    accountant_lock,
    epsilon_for,
    extend_history,
    load_accountant_state,
    make_accountant,
    release_steps,
    save_accountant_state,
)
from fedweigh.secure.dp_config import DPConfig
from fedweigh.secure.grad_sample import FastGradSampler, PerSampleLoss, dp_optimizer_class
from fedweigh.train import TrainConfig, TrainResult, default_loss, make_loader, make_optimizer, run_epochs

__all__ = ["DPRoundReport", "DPSGD"]

logger = logging.getLogger("fedweigh.secure.dp_sgd")


@dataclass
class DPRoundReport:
    """What one round of DP-SGD spent: ``epsilon`` is the accountant's total after the round."""

    epsilon: float
    delta: float
    noise_multiplier: float
    sample_rate: float
    steps: int
    total_steps: int
    mode: str
    history: History = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """The figures a site reports with its round result."""
        return {"dp_epsilon": self.epsilon, "dp_noise_multiplier": self.noise_multiplier}


_ONEDNN_HINT_GIVEN = False


@dataclass(frozen=True)
class _RoundPlan:
    """One round's sampling: the plain loader (Opacus' engine reads it), the Poisson loader trained on,
    its rate q, the noise multiplier sigma and the steps planned (reserved in the accountant file)."""

    base_loader: Any
    loader: Any
    sample_rate: float
    sigma: float
    steps: int = 0


@dataclass(frozen=True)
class _PrivateTraining:
    """What trains a DP round: the model run (Opacus' wrapper or the model), the DP optimizer, the loss,
    and the per-sample gradient hooks to remove afterwards (fedweigh's sampler or Opacus' wrapper)."""

    model: nn.Module
    optimizer: Any
    criterion: Any
    sampler: FastGradSampler | None = None
    wrapped: Any = None


def _hint_onednn_cache(device: str | torch.device) -> None:
    """Log once that DP-SGD on CPU wants a larger oneDNN primitive cache (Poisson batches vary in size)."""
    global _ONEDNN_HINT_GIVEN
    if (
        _ONEDNN_HINT_GIVEN
        or torch.device(device).type != "cpu"
        or os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    ):
        return
    _ONEDNN_HINT_GIVEN = True
    logger.info(
        "DP-SGD on CPU: Poisson batches vary in size and overflow oneDNN's primitive cache (1,024); set "
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY=8192 in the environment before the first convolution "
        "(about 2x faster DP epochs of the compact DenseNet)"
    )


def _check_dp_compatible(model: nn.Module, site: str) -> None:
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        raise ValueError(
            f"{site}: DP-SGD cannot train this model ({len(errors)} problem(s), e.g. {errors[0]}); build it with "
            "norm='group' or 'instance' (ClientArgs switches 'batch' to 'group' when DP-SGD is on) or pass it "
            "through fedweigh.models.make_opacus_compatible"
        )


class DPSGD:
    """DP-SGD for one site across the rounds of a job, with a persistent privacy accountant.

    Args:
        config: the job's DP-SGD settings.
        state_path: JSON file that keeps the accountant history between rounds and client processes
            (None: memory only, e.g. in-process runs). An existing file is loaded, and re-read under its
            lock before and after every round (module docstring).
        site_name: names the site in messages.
        seed: seeds Poisson sampling and noise, for reproducible tests only. The default (None) draws
            fresh seeds from the OS each round: the job's seed is known to the server, and noise it
            could regenerate would protect nothing.
        guard: the site policy's epsilon caps (:class:`fedweigh.site.policy.PrivacyGuard`): asked before
            each round with the epsilon the round would reach, its delta and N_k (it raises to refuse
            the round), told after it what was reached. None: no caps beyond the job's target.
    """

    def __init__(
        self,
        config: DPConfig,
        state_path: str | Path | None = None,
        site_name: str = "site",
        seed: int | None = None,
        guard: Any = None,
    ) -> None:
        self.config = config
        self.state_path = Path(state_path) if state_path is not None else None
        self.site_name = site_name
        self.seed = seed
        self.guard = guard
        self.accountant = make_accountant(config.accountant)
        self.noise_multiplier: float | None = config.noise_multiplier
        self.sample_rate: float | None = None
        self.rounds: list[dict] = []
        self._epsilon_cache: dict[tuple, float] = {}
        #: the ledger account of this accountant's running total (None: the guard's job id)
        self.account: str | None = None if self.state_path is None else f"accountant:{self.state_path.name}"
        self._lock = None if self.state_path is None else accountant_lock(self.state_path)
        if self.state_path is not None and self.state_path.is_file():
            self._load()

    # ---------------------------------------------------------------- persistence
    def _load(self) -> None:
        assert self.state_path is not None
        state = load_accountant_state(self.state_path, self.config, self.site_name)
        self.accountant.history = state.history
        self.noise_multiplier = state.noise_multiplier
        self.sample_rate = state.sample_rate
        self.rounds = state.rounds
        logger.info(
            "%s: DP-SGD accountant reloaded from %s (%d steps, epsilon %.4f)",
            self.site_name,
            self.state_path,
            self.total_steps,
            self.epsilon(),
        )

    def _reread(self) -> bool:
        """Inside the lock: take the history (and rounds) other processes on the file may have extended.
        Returns whether the file was there to read."""
        if self.state_path is None or not self.state_path.is_file():
            return False
        state = load_accountant_state(self.state_path, self.config, self.site_name)
        self.accountant.history = state.history
        self.rounds = state.rounds
        if self.noise_multiplier is None:
            self.noise_multiplier = state.noise_multiplier
        if self.sample_rate is None:
            self.sample_rate = state.sample_rate
        return True

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the accountant file's lock (nothing to hold without a file)."""
        if self._lock is None:
            yield
            return
        with self._lock:
            yield

    def _save(self, history: History | None = None) -> None:
        """Write the account (``history``: the accountant's own by default) to the state file."""
        if self.state_path is None:
            return
        state = AccountantState(
            history=list(self.accountant.history if history is None else history),
            noise_multiplier=self.noise_multiplier,
            sample_rate=self.sample_rate,
            rounds=self.rounds,
        )
        save_accountant_state(self.state_path, self.config, self.site_name, state)

    # ---------------------------------------------------------------- accounting
    @property
    def total_steps(self) -> int:
        """Optimizer steps accounted so far (all rounds, all processes of this job)."""
        return int(sum(n for _, _, n in self.accountant.history))

    def epsilon(self) -> float:
        """The accountant's epsilon for the steps taken, at the configured delta (cached per history)."""
        return self._epsilon_of(self.accountant.history)

    def _epsilon_of(self, history: History) -> float:
        key = tuple(tuple(h) for h in history)
        if key not in self._epsilon_cache:
            self._epsilon_cache[key] = epsilon_for(history, self.config.delta, self.config.accountant)
        return self._epsilon_cache[key]

    def _noise_multiplier(self, sample_rate: float, steps_per_round: int, total_rounds: int | None) -> float:
        if self.noise_multiplier is not None:
            if (
                self.config.epsilon is not None
                and self.sample_rate is not None
                and self.sample_rate != sample_rate
            ):
                raise ValueError(
                    f"{self.site_name}: the DP-SGD noise was planned for sample rate {self.sample_rate}, this "
                    f"round's data gives {sample_rate} (did the site's training set or batch size change?)"
                )
            return float(self.noise_multiplier)
        from opacus.accountants.utils import get_noise_multiplier

        if not total_rounds or total_rounds < 1:
            raise ValueError(
                f"{self.site_name}: DP-SGD with a target epsilon needs the job's planned number of rounds "
                "(total_rounds) to spread the budget; pass it to SiteTrainer.run_round, or give a noise multiplier"
            )
        total_steps = int(total_rounds) * steps_per_round
        assert self.config.epsilon is not None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sigma = get_noise_multiplier(
                target_epsilon=self.config.epsilon,
                target_delta=self.config.delta,
                sample_rate=sample_rate,
                steps=total_steps,
                accountant=self.config.accountant,
            )
        logger.info(
            "%s: DP-SGD noise multiplier %.4f for epsilon %g, delta %g over %d rounds x %d steps (q = %.4g)",
            self.site_name,
            sigma,
            self.config.epsilon,
            self.config.delta,
            total_rounds,
            steps_per_round,
            sample_rate,
        )
        return float(sigma)

    def _resolve_mode(self, model: nn.Module) -> str:
        if self.config.mode != "auto":
            return self.config.mode
        problems = FastGradSampler.unsupported(model)
        if problems:
            logger.info(
                "%s: DP-SGD uses Opacus' hooks (fast mode cannot handle %s)", self.site_name, problems
            )
            return "hooks"
        return "fast"

    def _generator(self, stream: int) -> torch.Generator:
        if self.seed is None:
            return torch.Generator().manual_seed(secrets.randbits(63))
        return torch.Generator().manual_seed(self.seed * 1_000_003 + 2 * len(self.rounds) + stream)

    # ---------------------------------------------------------------- training
    def _plan(self, data: LabeledImages, cfg: TrainConfig, total_rounds: int | None) -> _RoundPlan:
        """This round's Poisson loader, rate q, steps and sigma, checked against the site policy's caps
        and the target epsilon before anything is trained (:class:`PrivacyBudgetExhausted`); with a state
        file, on the history re-read under its lock, and the planned steps reserved in it."""
        from opacus.data_loader import DPDataLoader

        base_loader = make_loader(data, cfg.batch_size, shuffle=False, seed=0)
        loader = DPDataLoader.from_data_loader(base_loader, generator=self._generator(0))
        sample_rate = float(loader.sample_rate)
        planned = cfg.epochs * len(loader)
        steps = planned if cfg.max_steps is None else min(planned, cfg.max_steps)
        with self._locked():
            self._reread()
            sigma = self._noise_multiplier(sample_rate, steps, total_rounds)
            reserved = extend_history(self.accountant.history, sigma, sample_rate, steps)
            after = self._epsilon_of(reserved)
            if self.config.epsilon is not None:
                if after > self.config.epsilon * (1 + 1e-9):
                    raise PrivacyBudgetExhausted(
                        f"{self.site_name}: DP-SGD budget exhausted: {self.total_steps} steps spent epsilon "
                        f"{self.epsilon():.4f}; {steps} more would reach {after:.4f} > target "
                        f"{self.config.epsilon} (planned for {total_rounds} rounds)"
                    )
            if self.guard is not None:  # the policy's delta bound and caps (reserved), before any step
                self.guard.check(
                    "dp_sgd", after, delta=self.config.delta, num_samples=len(data), account=self.account
                )
            self.noise_multiplier, self.sample_rate = sigma, sample_rate
            self._save(reserved)  # other processes on the file count the planned steps from now on
        return _RoundPlan(base_loader, loader, sample_rate, sigma, steps)

    def _book(self, plan: _RoundPlan, taken: int, mode: str) -> DPRoundReport:
        """After training: under the lock, the file's history (re-read) with the round's reservation
        replaced by the ``taken`` steps, saved, and its epsilon recorded with the guard."""
        with self._locked():
            if self._reread():  # the reservation and whatever other processes added meanwhile
                history = release_steps(self.accountant.history, plan.sigma, plan.sample_rate, plan.steps)
                self.accountant.history = extend_history(history, plan.sigma, plan.sample_rate, taken)
            report = self._report(taken, mode)
            self.rounds.append({"steps": taken, "epsilon": report.epsilon, "mode": mode})
            self._save()
            if self.guard is not None:
                self.guard.record("dp_sgd", report.epsilon, self.config.delta, account=self.account)
        return report

    def _make_private(
        self, model: nn.Module, optimizer: Any, criterion: Any, plan: _RoundPlan, mode: str, num_samples: int
    ) -> _PrivateTraining:
        """The model, DP optimizer and loss that clip and noise each step (fedweigh's fast per-sample
        gradients or Opacus' ``mode``), accounting every step with the rate of ``plan``'s loader."""
        noise_gen = self._generator(1)
        expected_batch_size = max(1, int(num_samples * plan.sample_rate))
        step_hook = self.accountant.get_optimizer_hook_fn(sample_rate=plan.sample_rate)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Ss]ecure RNG.*")
            warnings.filterwarnings("ignore", message=".*full_backward_hook.*")
            if mode == "fast":
                sampler = FastGradSampler(model)
                dp_optimizer = dp_optimizer_class()(
                    optimizer,
                    noise_multiplier=plan.sigma,
                    max_grad_norm=self.config.max_grad_norm,
                    expected_batch_size=expected_batch_size,
                    loss_reduction="mean",
                    generator=noise_gen,
                )
                dp_optimizer.attach_step_hook(step_hook)
                return _PrivateTraining(model, dp_optimizer, criterion, sampler=sampler)
            from opacus import PrivacyEngine

            engine = PrivacyEngine(accountant=self.config.accountant)
            engine.accountant = self.accountant
            made = engine.make_private(
                module=model,
                optimizer=optimizer,
                data_loader=plan.base_loader,
                criterion=criterion,
                noise_multiplier=plan.sigma,
                max_grad_norm=self.config.max_grad_norm,
                grad_sample_mode=mode,
                noise_generator=noise_gen,
            )
            if mode == "ghost":
                wrapped, dp_optimizer, criterion, _ = made
            else:
                wrapped, dp_optimizer, _ = made
            # account with the Poisson rate of the loader used below (Opacus' own loader is not used)
            dp_optimizer.step_hook = None
            dp_optimizer.attach_step_hook(step_hook)
            return _PrivateTraining(wrapped, dp_optimizer, criterion, wrapped=wrapped)

    @staticmethod
    def _run(model: nn.Module, private: _PrivateTraining, loader: Any, cfg: TrainConfig) -> TrainResult:
        """Train the round; the per-sample gradient hooks and buffers are removed whatever happens."""
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*[Ff]ull backward hook.*")
                return run_epochs(
                    private.model,
                    loader,
                    private.optimizer,
                    private.criterion,
                    cfg.epochs,
                    cfg.max_steps,
                    None,
                    device=cfg.device,
                )
        finally:
            if private.sampler is not None:
                private.sampler.remove()
            if private.wrapped is not None:
                private.wrapped._close()
            for p in model.parameters():
                for attr in ("summed_grad", "grad_sample", "_processed"):
                    if hasattr(p, attr):
                        delattr(p, attr)
                p.grad = None

    def train_round(
        self,
        model: nn.Module,
        data: LabeledImages,
        cfg: TrainConfig,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        global_params: Mapping[str, np.ndarray | torch.Tensor] | None = None,
        total_rounds: int | None = None,
    ) -> tuple[TrainResult, DPRoundReport]:
        """One round of local DP-SGD on ``model`` (in place); returns the training result and what it spent.

        Uses ``cfg``'s epochs, batch size (the expected Poisson batch), optimizer and ``max_steps``.
        With ``cfg.fedprox_mu > 0`` and ``global_params``, FedProx's gradient mu (theta - theta_g) is added
        to the noised gradient: it does not depend on the data, so it costs no privacy (a proximal term in
        the loss would be clipped with each sample's gradient instead). Raises
        :class:`PrivacyBudgetExhausted` before training if the round would take epsilon above the target.
        """
        _check_dp_compatible(model, self.site_name)
        model.to(cfg.device)
        if len(data) == 0 or cfg.epochs == 0:
            return TrainResult(0, 0, float("nan")), self._report(0, "none")
        mode = self._resolve_mode(model)
        _hint_onednn_cache(cfg.device)
        plan = self._plan(data, cfg, total_rounds)
        self.noise_multiplier, self.sample_rate = plan.sigma, plan.sample_rate

        criterion: Any = PerSampleLoss(loss_fn if loss_fn is not None else default_loss(data.task), data.task)
        optimizer = make_optimizer(model, cfg)
        private = self._make_private(model, optimizer, criterion, plan, mode, len(data))
        if cfg.fedprox_mu > 0 and global_params is not None:
            self._add_prox_after_noise(private.optimizer, model, global_params, cfg.fedprox_mu)
        before = self.total_steps
        result = self._run(model, private, plan.loader, cfg)
        taken = self.total_steps - before
        if taken != result.num_steps:
            raise RuntimeError(
                f"{self.site_name}: the accountant recorded {taken} steps, training took {result.num_steps}"
            )
        return result, self._book(plan, result.num_steps, mode)

    @staticmethod
    def _add_prox_after_noise(
        optimizer: Any, model: nn.Module, global_params: Mapping[str, np.ndarray | torch.Tensor], mu: float
    ) -> None:
        """Chain FedProx's gradient mu (theta - theta_g) after the accountant's step hook (post-noise)."""
        anchors = []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if name not in global_params:
                raise KeyError(f"FedProx under DP-SGD: global parameters lack {name!r}")
            anchors.append(
                (p, torch.as_tensor(global_params[name]).detach().to(device=p.device, dtype=p.dtype))
            )
        accountant_hook = optimizer.step_hook

        def hook(opt: Any) -> None:
            if accountant_hook is not None:
                accountant_hook(opt)
            with torch.no_grad():
                for p, g in anchors:
                    if p.grad is not None:
                        p.grad.add_(p.detach() - g, alpha=mu)

        optimizer.step_hook = hook

    def _report(self, steps: int, mode: str) -> DPRoundReport:
        return DPRoundReport(
            epsilon=self.epsilon(),
            delta=self.config.delta,
            noise_multiplier=float(self.noise_multiplier or 0.0),
            sample_rate=float(self.sample_rate or 0.0),
            steps=steps,
            total_steps=self.total_steps,
            mode=mode,
            history=[tuple(h) for h in self.accountant.history],
        )
