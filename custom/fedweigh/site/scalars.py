"""Plan -> client scalars: what a site reports for the server's weighting scheme, computed once, here.

The server sends a plan with every training task (:meth:`fedweigh.server.rounds.RoundStep.plan`):
the ``scheme``, its ``scheme_args`` and ``scalars``, the names the scheme needs from clients (e.g.
CBR's ``skew``; FedDRAW's ``similarity`` under HE). :func:`plan_scalars` builds the scheme and lets
its own client code compute them from a :class:`fedweigh.weighting.base.ScalarContext`. Every client
calls it: fedweigh's (:meth:`fedweigh.site.trainer.SiteTrainer.scheme_scalars`), a script of your
own (:func:`fedweigh.flare.byo.result_meta`) and the MONAI Bundle client (through ``result_meta``),
so the three can never report differently.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedweigh.weighting import get_scheme
from fedweigh.weighting.base import ScalarContext
from fedweigh.weighting.geometry import use_model_buffers

__all__ = ["MODEL_SCALARS", "plan_scalars", "wanted_scalars"]

#: Client scalars computed from the model alone (FedDRAW's similarity): reporting only these releases
#: nothing of the label histogram, so no statistics release (and no statistics budget) is made for them.
MODEL_SCALARS: tuple[str, ...] = ("similarity",)


def wanted_scalars(plan: Mapping[str, Any]) -> tuple[str, ...]:
    """The scalar names the plan asks for (none when it names no scheme)."""
    if not plan.get("scheme"):
        return ()
    return tuple(plan.get("scalars") or ())


def plan_scalars(
    plan: Mapping[str, Any], ctx: ScalarContext, *, model: Any = None, who: str = "client"
) -> dict[str, float]:
    """The scalars ``plan`` asks for, computed by its scheme's ``client_scalars(ctx)``, in plan order.

    ``model``: the site's torch module, when at hand: parameter-comparing schemes then leave out its
    exact buffers (else the buffers are told by name, :func:`fedweigh.weighting.geometry.is_buffer_name`).
    Only what the plan asks for is returned, never more. Raises ValueError naming ``who`` when the
    scheme computes a scalar it asks for only from inputs the site did not give.
    """
    wanted = wanted_scalars(plan)
    if not wanted:
        return {}
    scheme = get_scheme(plan["scheme"], **(plan.get("scheme_args") or {}))
    use_model_buffers(scheme, model)
    computed = scheme.client_scalars(ctx)
    missing = [k for k in wanted if k not in computed]
    if missing:
        raise ValueError(
            f"{who}: scheme {plan['scheme']!r} asks for {missing}, which it computes only from the site's "
            "trained and global parameters or the global statistics"
        )
    return {k: float(computed[k]) for k in wanted}
