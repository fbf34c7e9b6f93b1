"""The benchmark's in-process sites under homomorphic encryption, as the NVFlare client runs them.

:class:`EncryptedInProcessSites` is the round loop's transport (:class:`fedweigh.server.loop.Transport`)
when the server's backend is :class:`fedweigh.server.encrypted.EncryptedGlobalModel`: per training
task, every target site decrypts the global model with the job's secret-key context
(:func:`fedweigh.secure.updates.decrypt_global`), judges it with its
:class:`fedweigh.site.he_guard.HEModelGuard` (accepts it, or refuses it and keeps its last good one),
trains on the model it uses, and sends Enc(update) against the model the server holds, its update
clipped by the guard (:meth:`HEModelGuard.encode`) and its policy's secure-sum minimum in clear: the
calls of :class:`fedweigh.flare.client.ClientLoop`. A site whose task fails (an attacker's own model
may be unusable) answers nothing, as an NVFlare site's failed task does. :meth:`EncryptedInProcessSites.alter` sees every
site's plaintext result before encryption (the attack suite's hook); the final scores are those of the
model the first site holds after it received the final global model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fedweigh.arrays import Params
from fedweigh.bench.sites import InProcessSites, LocalSites, SitePool, site_result
from fedweigh.protocol import ABSOLUTE_MIN, META_HE, META_HE_REFUSED, META_MIN_SECURE_SUM
from fedweigh.server.loop import TrainTask, ValidateTask
from fedweigh.server.rounds import ClientResult

logger = logging.getLogger(__name__)

__all__ = ["EncryptedInProcessSites", "HEKeys", "SiteReceipt"]


class HEKeys:
    """One CKKS key pair as a job holds it: ``secret`` at the sites, ``public`` (no secret key) at the
    server (:func:`fedweigh.secure.contexts.make_context`, the provisioning's parameters)."""

    def __init__(self) -> None:
        from fedweigh.secure.contexts import context_from_bytes, make_context, serialize_context

        self.secret = make_context()
        self.public = context_from_bytes(serialize_context(self.secret, with_secret_key=False), role="server")


@dataclass
class SiteReceipt:
    """What one site made of the task's global model: the decrypted model (its layout), the guard's
    receipt (the model it uses and why it refused the received one, if it did)."""

    decrypted: Any
    receipt: Any


class EncryptedInProcessSites(InProcessSites):
    """The benchmark's in-process sites under HE (module docstring).

    Args:
        sites: the cell's sites (in this process: each site's model is decrypted and trained in turn).
        score: the server's own metrics of a plaintext model (the benchmark's test set).
        keys: the job's key pair (:class:`HEKeys`).
        min_secure_sum: each site's policy minimum, sent in clear with its result.
        precision_bits: the job's ``he_precision_bits`` (None: the default).
    """

    def __init__(
        self,
        sites: LocalSites | SitePool,
        score: Callable[[Params], dict[str, float]],
        keys: HEKeys,
        min_secure_sum: int = ABSOLUTE_MIN,
        precision_bits: int | None = None,
    ):
        if not isinstance(sites, LocalSites):
            raise ValueError("sites under HE train in this process (site_workers=1)")
        super().__init__(sites, score)
        from fedweigh.site.he_guard import HEModelGuard

        self.keys = keys
        self.min_secure_sum = int(min_secure_sum)
        self.precision_bits = precision_bits
        self.guards = {name: HEModelGuard(name) for name in sites.names}
        #: the server's metrics of the last model a site decrypted for scoring (global_metrics reads them)
        self._measured: dict[str, float] = {}
        #: per round (the final model: T + 1), the sites that refused the global model they decrypted
        self.refusals: dict[int, list[str]] = {}

    def receive(
        self, site: str, params: Mapping[str, Any], meta: Mapping[str, Any], t: int | None
    ) -> SiteReceipt:
        """``site`` decrypts and judges the model ``params`` (round ``t``; None: the final model)."""
        from fedweigh.secure.updates import decrypt_global
        from fedweigh.train import get_params

        he_meta = dict(meta.get(META_HE) or {})
        reference = get_params(self.sites.trainers[site].model)  # the site's own model, as the client's
        decrypted = decrypt_global(
            self.keys.secret, params, he_meta, reference, self.min_secure_sum, self.precision_bits
        )
        receipt = self.guards[site].receive(decrypted, t, he_meta.get("steps"))
        if receipt.refusal:
            self.refusals.setdefault(-1 if t is None else int(t), []).append(site)
        return SiteReceipt(decrypted, receipt)

    def check_slot(self, site: str) -> float:
        """The check slot ``site`` encrypts when it sends as it is (1; an attack may forge it)."""
        return 1.0

    def alter(self, task: TrainTask, results: Sequence[ClientResult], receipts: Mapping[str, SiteReceipt]):
        """The sites' plaintext results before encryption (each ``params`` the trained model); an
        attack overrides this. Returns (results, the sites that encrypt as they are, without their
        guard's clipping)."""
        return list(results), set()

    def train(self, task: TrainTask) -> list[ClientResult]:
        receipts = {
            site: self.receive(site, task.params, task.meta, task.round_index) for site in task.targets
        }
        if task.evaluate:  # the model the first target uses, scored as the server would score the plaintext
            self._measured = self.score(receipts[task.targets[0]].receipt.use)
        plain = []
        for site in task.targets:
            use = receipts[site].receipt.use
            try:
                outs = self.sites.run_round(
                    [site], use, task.round_index, dict(task.plan), task.num_rounds, task.evaluate
                )
            except Exception as e:  # as an NVFlare site whose task fails: no result this round
                logger.warning("round %d: %s failed its training task: %s", task.round_index, site, e)
                continue
            plain.append(site_result(site, outs[site]))
        if not plain:
            return []
        plain, unclipped = self.alter(task, plain, receipts)
        sent = []
        for result in plain:
            here = receipts[result.site]
            layout, receipt = here.decrypted.layout, here.receipt
            if result.site in unclipped:
                from fedweigh.secure.updates import encode_update

                encoded = encode_update(
                    self.keys.secret,
                    result.params,
                    receipt.received,
                    layout,
                    check=self.check_slot(result.site),
                )
            else:
                steps = int(dict(result.meta or {}).get("NUM_STEPS_CURRENT_ROUND", 0))
                encoded = self.guards[result.site].encode(
                    self.keys.secret, result.params, receipt, layout, steps
                )
            meta = {**dict(result.meta or {}), META_MIN_SECURE_SUM: self.min_secure_sum}
            if receipt.refusal:
                meta[META_HE_REFUSED] = receipt.refusal
            sent.append(replace(result, params=encoded, meta=meta))
        return sent

    def held(self, params: Mapping[str, Any], meta: Mapping[str, Any], site: str | None = None) -> Params:
        """The plaintext model ``site`` (default: the first) uses after receiving ``params``."""
        site = site or self.sites.names[0]
        return self.receive(site, params, meta, None).receipt.use

    def validate(self, task: ValidateTask) -> list[dict[str, float]]:
        """Every site's metrics of the final model, each on the model it uses after receiving it; the
        first site's model is the one :meth:`global_metrics` scores."""
        from fedweigh.train import set_params

        out = []
        for site in sorted(task.targets):
            held = self.held(task.params, task.meta, site)
            if site == sorted(task.targets)[0]:
                self._measured = self.score(held)
            trainer = self.sites.trainers[site]
            set_params(trainer.model, held)
            try:
                out.append(trainer.evaluate())
            except Exception as e:  # as an NVFlare site whose task fails: no answer
                logger.warning("%s failed its validation task: %s", site, e)
        return out

    def global_metrics(self, params: Params) -> dict[str, float]:
        """The server holds ciphertext: the scores of the model the site decrypted last for scoring."""
        measured, self._measured = self._measured, {}
        return measured
