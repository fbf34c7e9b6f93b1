"""A site's checks on the global model it decrypts under HE, and the update it encrypts.

Under HE (:mod:`fedweigh.secure.updates`) the server cannot read any update, so it cannot bound or
leave out a bad one: one site can add any values to the encrypted sum. Only the sites see the result,
after decryption. :class:`HEModelGuard` is what each site does with it, every round:

1. Check the decrypted global model theta_g^t before using it: every value finite; BatchNorm
   variances (``*running_var``) non-negative; the check slot as the server announced it (a forged
   one is named as such, :attr:`fedweigh.secure.updates.DecryptedGlobal.check_problem`); and the
   size of the global update Delta_g = theta_g^t - theta_good against this site's references,
   per array a of the encrypted layout,

       r_a = ||Delta_g[a]|| / max(||Delta_own[a]|| * max(1, tau_round / tau_own), median_s ||Delta_g^s[a]||),
       refuse when median_a r_a > RATIO_BOUND (4),

   where Delta_own is this site's own (clipped) last update, tau_own its local steps, tau_round the
   weighted median of the steps the server summed (announced with the model in clear; a site that
   trained fewer steps than most expects a larger aggregate than its own update) and Delta_g^s the
   global updates it accepted earlier. An honest aggregate is a weighted mean of updates like the
   site's own, so r_a stays near 1: measured 0.5-2.1 with equal steps (SynthCXR, 4 sites, 10 steps
   each); 4-9 for sites of 1-3 steps against one of 63 before the step scaling, 0.15 after. A site
   adding 0.1 to every value of its update among four sites of equal steps gives r_a of 5-16.

   Then the DIRECTION of Delta_g (flattened over the encrypted arrays), against two references:

       cos_own   = cos(Delta_g, Delta_own)       (this site's own last update, the one in this sum)
       cos_trend = cos(Delta_g, m),  m <- TREND_DECAY m + Delta_g^s / ||Delta_g^s||  (accepted ones)
       refuse when max(cos_own, cos_trend) < DIRECTION_BOUND (0.15), over the references known.

   An honest aggregate is a weighted mean of updates that each correlate with the site's own and
   with the recent trend, so at least one cosine stays high; a site sending its update negated and
   boosted cancels or reverses the common part: with 4 equal weights and honest updates of pairwise
   correlation rho, -3 x one update leaves cos_own = sqrt((1 - rho) / 12) and cos_trend near 0.
   Measured (benchmarks/bench_he_direction.py, docs/results/he-direction/: SynthCXR 32 px, 4 sites,
   10 local steps, iid-4 with FedAvg and the HE job's quantity-shift with FedDRAW, 3 seeds of 6
   rounds and 2 of 10): on 304 honest site-rounds max(cos_own, cos_trend) min 0.24, 5th percentile
   0.53, median 0.83, no round refused (cos_own alone goes down to 0.23 in late rounds at a site of small weight;
   the trend holds it up; 0.3 refused one honest round of ten, hence 0.15). Site-4
   sending -3 x its update (iid-4): max(cos_own, cos_trend) at most 0.10 without the check, refused in every round (without
   the check none; -4 x: from round 2 instead of round 4, when a BatchNorm variance goes negative).
   The sites then keep the initial model (AUC 0.41 against 0.46 without the check, 0.73 clean): the
   attack is named, its damage is not undone while it goes on. A negated update of factor -1 or -2 leaves the
   aggregate pointing along the honest sites' and is not refused (it slows training; the model
   stays along honest training). The site's first model (no last good one) is not judged; the
   first judged one has no trend yet (cos_own alone); with neither reference (no own update, e.g.
   after a restart: the vectors are kept in memory only) the direction is not judged. Memory: two
   flat float32 vectors (Delta_own and m) of the encrypted values.
2. When the check fails, keep the last good model theta_good, say why (a named refusal in the result's
   meta and the site's log), and train on theta_good instead. The update sent is still taken against
   the model the server holds, Delta = theta_good + clip(theta_k - theta_good) - theta_g^t, so the
   honest sites' updates pull the server's sum back to theta_good (and a forged check slot back to the
   announced value: the update's check slot is 1 + expected - decrypted); the attacker's share stays
   in it as long as it keeps attacking, and the sites keep refusing.
3. Clip its own update theta_k - theta_good to CLIP_FACTOR (3) times the median norm of the global
   updates it accepted before (no clipping before it has accepted one), as DP-FedAvg clips (McMahan
   et al., ICLR 2018), so that an honest site's update stays within what the other sites accept.

A contribution encrypted under another key decrypts to values beyond the encoding's range: that is
no model to repair, and the site refuses the task (ValueError) as before.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["CLIP_FACTOR", "DIRECTION_BOUND", "RATIO_BOUND", "TREND_DECAY", "HEModelGuard", "HEReceipt"]

logger = logging.getLogger("fedweigh.site.he_guard")

#: Refuse a decrypted global model whose update is, in the median over arrays, this many times the
#: site's reference norm of that array (module docstring).
RATIO_BOUND = 4.0
#: A site clips its own update to this many times the median norm of the global updates it accepted.
CLIP_FACTOR = 3.0
#: Refuse a decrypted global model whose update has a cosine below this bound both with the site's own
#: last update and with the trend of the global updates it accepted (module docstring).
DIRECTION_BOUND = 0.15
#: The trend: m <- TREND_DECAY * m + Delta_g / ||Delta_g|| over the accepted global updates.
TREND_DECAY = 0.5


def _norms(
    new: Mapping[str, np.ndarray], old: Mapping[str, np.ndarray], keys: Sequence[str]
) -> dict[str, float]:
    """||new[a] - old[a]|| (float64) for every array a of ``keys``."""
    return {
        k: float(np.linalg.norm(np.asarray(new[k], np.float64) - np.asarray(old[k], np.float64)))
        for k in keys
    }


def _flat(new: Mapping[str, np.ndarray], old: Mapping[str, np.ndarray], keys: Sequence[str]) -> np.ndarray:
    """new - old over the arrays ``keys``, flattened and concatenated (float32, ``keys`` order)."""
    return np.concatenate(
        [
            (np.asarray(new[k], np.float64) - np.asarray(old[k], np.float64)).ravel().astype(np.float32)
            for k in keys
        ]
        or [np.zeros(0, np.float32)]
    )


def _cosine(a: np.ndarray, b: np.ndarray | None) -> float | None:
    """<a, b> / (||a|| ||b||) (float64 sums), or None when ``b`` is missing, of another length or either is 0."""
    if b is None or a.shape != b.shape:
        return None
    na, nb = float(np.linalg.norm(a.astype(np.float64))), float(np.linalg.norm(b.astype(np.float64)))
    if not (na > 0 and nb > 0 and math.isfinite(na) and math.isfinite(nb)):
        return None
    return float(np.dot(a.astype(np.float64), b.astype(np.float64)) / (na * nb))


@dataclass(frozen=True)
class HEReceipt:
    """What the site made of a received global model: the model it trains on (the received one, or its
    last good one), why it refused the received one (None: accepted), and the check-slot value its
    next update carries (1, or the repair of a forged check slot)."""

    received: dict[str, np.ndarray]
    use: dict[str, np.ndarray]
    refusal: str | None = None
    check: float = 1.0


class HEModelGuard:
    """One site's last good global model and references across the rounds of a job (module docstring).

    Args:
        site: the site's name (in messages).
        ratio_bound: :data:`RATIO_BOUND`.
        clip_factor: :data:`CLIP_FACTOR`; None: no clipping.
        direction_bound: :data:`DIRECTION_BOUND`; None: the direction is measured but not judged.
    """

    def __init__(
        self,
        site: str,
        ratio_bound: float = RATIO_BOUND,
        clip_factor: float | None = CLIP_FACTOR,
        direction_bound: float | None = DIRECTION_BOUND,
    ):
        self.site = site
        self.ratio_bound = float(ratio_bound)
        self.clip_factor = clip_factor
        self.direction_bound = None if direction_bound is None else float(direction_bound)
        #: this site's own last (clipped) update and the decayed sum of the unit directions of the global
        #: updates it accepted: flat float32 vectors over the encrypted arrays (None: not yet known)
        self.own_vector: np.ndarray | None = None
        self.trend: np.ndarray | None = None
        #: the direction statistics of the last model judged: cos_own, cos_trend (None: no reference)
        self.direction: dict[str, float | None] = {}
        #: the last global model this site accepted (None before the first)
        self.last_good: dict[str, np.ndarray] | None = None
        #: per-array norms of the global updates accepted so far, and of this site's last own update
        #: with its local steps
        self.history: list[dict[str, float]] = []
        self.own: dict[str, float] | None = None
        self.own_steps = 0
        #: the weighted median of the local steps in the sum being judged (0: not announced)
        self.round_steps = 0
        #: the refusals so far (one line each)
        self.refusals: list[str] = []

    # -- checks -------------------------------------------------------------------------------------
    def refusal(self, params: Mapping[str, np.ndarray], keys: Sequence[str]) -> str | None:
        """Why ``params`` (a decrypted global model; ``keys``: its encrypted arrays) must not be used,
        or None."""
        self.direction = {}
        for key, value in params.items():
            arr = np.asarray(value)
            if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
                return f"the decrypted global model holds NaN or infinite values (in {key!r})"
            if key.endswith("running_var") and arr.size and float(arr.min()) < 0:
                return f"the decrypted global model has a negative BatchNorm variance ({key!r} down to {float(arr.min()):.3g})"
        if self.last_good is None:
            return None
        moved = _norms(params, self.last_good, keys)
        ratios = []
        scale = max(1.0, self.round_steps / self.own_steps) if self.own_steps > 0 else 1.0
        for key in keys:
            refs = [self.own.get(key, 0.0) * scale] if self.own else []
            if self.history:
                refs.append(float(np.median([h.get(key, 0.0) for h in self.history])))
            ref = max(refs, default=0.0)
            if ref > 0:
                ratios.append(moved[key] / ref)
        ratio = float(np.median(ratios)) if ratios else 0.0
        if ratio > self.ratio_bound:
            return (
                f"the global update is {ratio:.3g} times this site's reference in the median over {len(ratios)} "
                f"arrays (its own last update and the global updates it accepted; bound {self.ratio_bound:g}): "
                "a contribution far outside what honest training gives"
            )
        return self.direction_refusal(_flat(params, self.last_good, keys))

    def direction_refusal(self, delta: np.ndarray) -> str | None:
        """Why the global update ``delta`` (flat, :func:`_flat` of the encrypted arrays against the last
        good model) points against this site's references, or None; records the statistics in
        :attr:`direction`.

        cos_own = cos(Delta_g, Delta_own), cos_trend = cos(Delta_g, m); refused when every one that
        exists is below :attr:`direction_bound` (no reference yet, or a zero update: not judged)."""
        cos_own, cos_trend = _cosine(delta, self.own_vector), _cosine(delta, self.trend)
        self.direction = {"cos_own": cos_own, "cos_trend": cos_trend}
        known = [c for c in (cos_own, cos_trend) if c is not None]
        if self.direction_bound is None or not known or max(known) >= self.direction_bound:
            return None
        shown = ", ".join(
            f"{n} {c:.3g}" for n, c in (("own", cos_own), ("trend", cos_trend)) if c is not None
        )
        return (
            f"the global update points against this site's references: its cosine with this site's own "
            f"last update and with the trend of the global updates it accepted is below {self.direction_bound:g} "
            f"({shown}): a contribution that pulls against honest training"
        )

    def receive(self, decrypted, round_index: int | None = None, round_steps: object = None) -> HEReceipt:
        """Judge a :class:`fedweigh.secure.updates.DecryptedGlobal`: accept it (it becomes the last good
        model) or refuse it and keep the last good one. ``round_steps``: the weighted median of the
        steps summed, as the server announces it (``steps`` in the HE meta). ValueError when there is
        no model to use: a key mismatch, or a refused model before any was accepted."""
        params, keys = decrypted.params, decrypted.layout.keys
        valid = isinstance(round_steps, int | float) and not isinstance(round_steps, bool)
        self.round_steps = int(round_steps) if valid and math.isfinite(round_steps) and round_steps > 0 else 0
        check_problem = decrypted.check_problem
        if check_problem and "forged" not in check_problem:
            raise ValueError(check_problem)  # another key: nothing decrypted is usable
        why = check_problem or self.refusal(params, keys)
        when = f" received in round {round_index}" if round_index is not None else ""
        if why is None:
            if self.last_good is not None:
                moved = _norms(params, self.last_good, keys)
                if any(v > 0 for v in moved.values()):
                    self.history.append(moved)
                    self._add_to_trend(_flat(params, self.last_good, keys))
            self.last_good = {k: np.array(v) for k, v in params.items()}
            return HEReceipt(dict(params), self.last_good)
        if self.last_good is None:
            raise ValueError(
                f"{self.site} refuses the global model{when}: {why}; it holds no earlier good model"
            )
        message = f"{self.site} refuses the global model{when} and keeps its last good model: {why}"
        self.refusals.append(message)
        logger.error("%s", message)
        repair = 1.0
        if check_problem:  # pull the server's check slot back to what it announces
            repair = 1.0 + (decrypted.expected_check - decrypted.check)
        return HEReceipt(dict(params), self.last_good, message, repair)

    # -- the update ---------------------------------------------------------------------------------
    def clip_norm(self) -> float | None:
        """CLIP_FACTOR x the median total norm of the global updates accepted so far (None: no bound)."""
        if self.clip_factor is None or not self.history:
            return None
        totals = [math.sqrt(sum(v * v for v in h.values())) for h in self.history]
        return float(self.clip_factor * np.median(totals))

    def outgoing(
        self, trained: Mapping[str, np.ndarray], receipt: HEReceipt, keys: Sequence[str], steps: int = 0
    ) -> dict[str, np.ndarray]:
        """The parameters whose difference to ``receipt.received`` the site encrypts: the model it
        trained from plus its own update clipped (:func:`fedweigh.secure.updates.clip_update`); records
        that update's per-array norms as this site's reference."""
        from fedweigh.secure.updates import clip_update

        bound = self.clip_norm()
        clipped, norm = clip_update(trained, receipt.use, keys, bound)
        if bound is not None and norm > bound:
            logger.info("%s: own update norm %.4g clipped to %.4g", self.site, norm, bound)
        self.own = _norms(clipped, receipt.use, keys)
        self.own_vector = _flat(clipped, receipt.use, keys)
        self.own_steps = int(steps)
        return clipped

    def _add_to_trend(self, delta: np.ndarray) -> None:
        """m <- TREND_DECAY * m + delta / ||delta|| (a new start when the layout changed)."""
        norm = float(np.linalg.norm(delta.astype(np.float64)))
        if not (norm > 0 and math.isfinite(norm)):
            return
        unit = (delta / norm).astype(np.float32)
        if self.trend is None or self.trend.shape != unit.shape:
            self.trend = unit
        else:
            self.trend = (TREND_DECAY * self.trend + unit).astype(np.float32)

    def encode(
        self, ctx, trained: Mapping[str, np.ndarray], receipt: HEReceipt, layout, steps: int = 0
    ) -> dict[str, np.ndarray]:
        """What the site sends under HE: Enc(:meth:`outgoing` - theta_received) with the receipt's
        check slot (:func:`fedweigh.secure.updates.encode_update`), its clear arrays as they are."""
        from fedweigh.secure.updates import encode_update

        outgoing = self.outgoing(trained, receipt, layout.keys, steps)
        return encode_update(ctx, outgoing, receipt.received, layout, check=receipt.check)
