"""The DP-SGD privacy account of a site: epsilon from the history of steps, and its persistence.

A DP-SGD step with noise multiplier sigma and Poisson sampling rate q is a subsampled Gaussian
mechanism; the accountant composes the history of (sigma, q, steps) into the epsilon spent at a
given delta: RDP (Renyi DP, Mironov, CSF 2017; Mironov, Talwar & Zhang 2019 for the subsampled
Gaussian) or PRV (privacy random variables, Gopi, Lee & Wutschitz, NeurIPS 2021; tighter), both
from Opacus (Yousefpour et al., 2021). Steps at the same (sigma, q) are merged into one history
entry, as Opacus' accountants merge them (:func:`extend_history`).

In an NVFlare job a site keeps its account in :data:`DP_STATE_FILE` in its working folder
(:func:`dp_state_path`, :func:`save_accountant_state`), so a relaunched client process continues
the same account (:func:`load_accountant_state`) instead of starting again from zero. The file is
named by the budget id, so every job of a budget (a resumed run, or jobs started at once under one
id) continues the same history: :class:`fedweigh.secure.dp_sgd.DPSGD` re-reads it under
:func:`accountant_lock` before each round and writes it back extended, so their steps compose. The
file is trusted state: it is read only if the site's user alone can change it
(:func:`fedweigh.secure.file_checks.check_private_file`), and written with mode 0600.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock

from fedweigh.io import atomic_write_json
from fedweigh.secure.dp_config import ACCOUNTANTS, DPConfig, job_site_path
from fedweigh.secure.file_checks import check_private_file

__all__ = [
    "ACCOUNTANT_LOCK_TIMEOUT_S",
    "DP_STATE_FILE",
    "AccountantState",
    "History",
    "accountant_lock",
    "dp_state_path",
    "epsilon_for",
    "extend_history",
    "release_steps",
    "load_accountant_state",
    "make_accountant",
    "save_accountant_state",
]

#: File (in the client's working directory) that keeps a site's DP-SGD accountant for a job.
DP_STATE_FILE = "fedweigh_dp_sgd_{job_id}_{site}.json"
STATE_FORMAT = 1
#: How long a job waits for another job's round planning or bookkeeping on the same accountant file.
ACCOUNTANT_LOCK_TIMEOUT_S = 120.0

History = list[tuple[float, float, int]]


def make_accountant(name: str) -> Any:
    """A fresh Opacus accountant (``"rdp"`` or ``"prv"``)."""
    from opacus.accountants import create_accountant

    if name not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {name!r}")
    return create_accountant(mechanism=name)


def epsilon_for(history: History, delta: float, accountant: str = "rdp") -> float:
    """Epsilon of a history of (noise multiplier, sample rate, steps) under ``accountant``."""
    acc = make_accountant(accountant)
    acc.history = [(float(s), float(q), int(n)) for s, q, n in history]
    if not acc.history:
        return 0.0
    with warnings.catch_warnings():  # "optimal order is the largest alpha": the default orders are kept
        warnings.filterwarnings("ignore", message=".*largest alpha.*")
        return float(acc.get_epsilon(delta=delta))


def extend_history(history: History, sigma: float, sample_rate: float, steps: int) -> History:
    """``history`` after ``steps`` more steps at (sigma, q), merged as Opacus' accountants merge them."""
    if steps <= 0:
        return list(history)
    if history and history[-1][0] == sigma and history[-1][1] == sample_rate:
        return [*history[:-1], (sigma, sample_rate, history[-1][2] + steps)]
    return [*history, (sigma, sample_rate, steps)]


def release_steps(history: History, sigma: float, sample_rate: float, steps: int) -> History:
    """``history`` less ``steps`` steps at (sigma, q), taken from its entries at (sigma, q), the latest
    first (composition does not depend on the order of the steps). ValueError if it holds fewer."""
    if steps <= 0:
        return list(history)
    left, out = int(steps), list(history)
    for i in range(len(out) - 1, -1, -1):
        s, q, n = out[i]
        if s == sigma and q == sample_rate and left:
            taken = min(n, left)
            out[i], left = (s, q, n - taken), left - taken
    if left:
        raise ValueError(
            f"the DP-SGD accountant holds fewer than {steps} steps at (sigma={sigma}, q={sample_rate}) to release: "
            "its file was changed by something other than this site's DP-SGD"
        )
    return [h for h in out if h[2] > 0]


def accountant_lock(path: Path) -> FileLock:
    """The lock every process of the site takes on ``<path>.lock`` while it reads, checks and extends the
    accountant in ``path`` (``filelock``: ``fcntl.flock`` on POSIX)."""
    return FileLock(f"{path}.lock", timeout=ACCOUNTANT_LOCK_TIMEOUT_S)


def dp_state_path(job_id: str, site_name: str, folder: str | Path = ".") -> Path:
    """Where a site keeps its DP-SGD accountant for a job."""
    return job_site_path(DP_STATE_FILE, job_id, site_name, folder)


@dataclass
class AccountantState:
    """What a site's DP-SGD account keeps between rounds and client processes."""

    history: History = field(default_factory=list)
    noise_multiplier: float | None = None
    sample_rate: float | None = None
    #: per round: steps, epsilon after the round, per-sample gradient mode
    rounds: list[dict] = field(default_factory=list)


def load_accountant_state(path: Path, config: DPConfig, site_name: str = "site") -> AccountantState:
    """The account kept in ``path``; ValueError if unreadable or written for other DP-SGD settings.

    The file must name the same accountant, delta and target epsilon as ``config``, and only the site's
    user may be able to change it (PermissionError otherwise, naming the fix).
    """
    if Path(path).exists():  # a missing file is named below, as an unreadable one
        check_private_file(path, f"{site_name}: DP-SGD accountant", "anyone could erase the steps it counts")
    try:
        state = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{site_name}: cannot read the DP-SGD accountant {path}: {e}") from e
    if state.get("format") != STATE_FORMAT or state.get("accountant") != config.accountant:
        raise ValueError(
            f"{site_name}: {path} holds a '{state.get('accountant')}' accountant (format "
            f"{state.get('format')}), the job uses '{config.accountant}'"
        )
    if float(state["delta"]) != config.delta or state.get("target_epsilon") != config.epsilon:
        raise ValueError(
            f"{site_name}: {path} was written for (epsilon={state.get('target_epsilon')}, "
            f"delta={state['delta']}), the job asks for (epsilon={config.epsilon}, delta={config.delta})"
        )
    return AccountantState(
        history=[(float(s), float(q), int(n)) for s, q, n in state["history"]],
        noise_multiplier=state.get("noise_multiplier"),
        sample_rate=state.get("sample_rate"),
        rounds=list(state.get("rounds", [])),
    )


def save_accountant_state(path: Path, config: DPConfig, site_name: str, state: AccountantState) -> None:
    """Write the account to ``path`` atomically (a crash never leaves a half-written account)."""
    atomic_write_json(
        path,
        {
            "format": STATE_FORMAT,
            "site": site_name,
            "accountant": config.accountant,
            "target_epsilon": config.epsilon,
            "delta": config.delta,
            "max_grad_norm": config.max_grad_norm,
            "noise_multiplier": state.noise_multiplier,
            "sample_rate": state.sample_rate,
            "history": [list(h) for h in state.history],
            "rounds": state.rounds,
        },
        indent=1,
    )
