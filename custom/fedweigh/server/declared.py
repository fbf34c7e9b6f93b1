"""The consortium's declaration of each site's training-set size: the sizes that may drive weights.

A sample count N_k travels in a round's clear meta, and nothing in a round can verify it: a site that
reports 1,000 times its size buys the weight FedAvg, FedDRAW's size prior or FedNova's p_k give it.
What the federation can verify is what its members agreed on when they joined: a declaration of the
sites' sizes, which the round step (:class:`~fedweigh.server.safeguards.Safeguards`
``declared_sizes``) uses as an upper bound on every reported N_k (a site missing from it counts at most
the smallest declared size). docs/security.md, "Bounded influence".

The declaration is a JSON object ``{"site-1": 1200, "site-2": 300, ...}``: given to a job
(``declared_sizes=`` of the recipes and :class:`~fedweigh.flare.controller.FedweighController`, a
mapping or the path of such a file), or placed by the server's operator in the file that
:data:`DECLARED_SIZES_ENV` names, which no job can change; with both, each site counts at most the
smaller of the two.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from fedweigh.checks import declaration_problem
from fedweigh.errors import ConfigError

__all__ = [
    "DECLARED_SIZES_ENV",
    "combine_declarations",
    "load_declared_sizes",
    "server_declaration",
]

#: The server's environment variable naming the operator's declaration file (JSON, site -> N_k).
DECLARED_SIZES_ENV = "FEDWEIGH_DECLARED_SIZES"


def _checked(raw: object, where: str) -> dict[str, int]:
    problem = declaration_problem(raw)
    if problem is not None:
        raise ConfigError(where, *problem)
    return {str(site): int(count) for site, count in raw.items()}


def load_declared_sizes(value: Mapping[str, int] | str | Path | None, where: str) -> dict[str, int] | None:
    """The declaration ``value`` gives: a mapping as it is, a path read as a JSON file; None: none.
    ConfigError naming ``where`` (and the file) and what is wrong."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return _checked(value, where)
    path = Path(os.path.expanduser(str(value)))
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(
            where, "declared_sizes", str(path), f"cannot read the file: {e.strerror or e}"
        ) from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            where, "declared_sizes", str(path), f"not JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        ) from None
    return _checked(raw, f"{where} ({path})")


def server_declaration(environ: Mapping[str, str] | None = None) -> dict[str, int] | None:
    """The operator's declaration: the file :data:`DECLARED_SIZES_ENV` names (None when unset)."""
    path = (os.environ if environ is None else environ).get(DECLARED_SIZES_ENV)
    return load_declared_sizes(path, DECLARED_SIZES_ENV) if path else None


def combine_declarations(*declarations: Mapping[str, int] | None) -> dict[str, int] | None:
    """One declaration from several (None ignored): the sites any of them names, each at the smallest
    size declared for it; None when none is given."""
    given = [d for d in declarations if d is not None]
    if not given:
        return None
    out: dict[str, int] = {}
    for d in given:
        for site, count in d.items():
            out[site] = min(out.get(site, count), int(count))
    return out
