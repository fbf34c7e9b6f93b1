"""Parameter dictionaries as numpy arrays: conversion from tensors and the check against a reference.

Every place that receives a model (the round step, the encrypted path, a site decoding the global
model) converts with :func:`to_numpy` / :func:`to_numpy_dict` and checks with
:func:`check_same_layout`, so a client's parameters are judged by one rule everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["Params", "check_same_layout", "to_numpy", "to_numpy_dict"]

Params = dict[str, np.ndarray]

#: Kinds of number a parameter may be: floating-point, integer (signed or not) or boolean.
_KIND = {"f": "float", "i": "integer", "u": "integer", "b": "bool"}


def to_numpy(value: Any) -> np.ndarray:
    """``value`` as a numpy array (a torch tensor is detached and moved to the CPU first)."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def to_numpy_dict(params: Mapping[str, Any]) -> Params:
    """Every entry of ``params`` as a numpy array, in the same order."""
    return {k: to_numpy(v) for k, v in params.items()}


def check_same_layout(
    who: str, params: Mapping[str, Any], reference: Mapping[str, Any], *, finite: bool = True
) -> Params:
    """``params`` as numpy arrays, in ``reference`` order, after checking that they fit the reference.

    Raises ValueError naming ``who`` and the first problem: a missing or unexpected key, a shape
    that differs, a non-numeric array (strings, objects, complex numbers), an array of another kind
    of number than the reference (integers where it holds floating-point values, or the reverse;
    the precision may differ), or (with ``finite``) a NaN or infinite value in a floating-point array.
    """
    missing = [k for k in reference if k not in params]
    unexpected = [k for k in params if k not in reference]
    if missing or unexpected:
        raise ValueError(
            f"{who}: parameter keys differ from the global model: it lacks {len(missing)} "
            f"(missing {missing[:5]}) and has {len(unexpected)} unexpected (unexpected {unexpected[:5]})"
        )
    out: Params = {}
    for key, ref in reference.items():
        try:
            arr = to_numpy(params[key])
        except (TypeError, ValueError) as e:
            raise ValueError(f"{who}: parameter {key!r} is not an array ({e})") from None
        ref_shape = np.shape(ref)
        if arr.shape != ref_shape:
            raise ValueError(f"{who}: parameter {key!r} has shape {arr.shape}, expected {ref_shape}")
        if arr.dtype.kind not in "fiub":
            raise ValueError(f"{who}: parameter {key!r} has dtype {arr.dtype}, expected a real number type")
        ref_kind = _KIND.get(np.asarray(ref).dtype.kind)
        if ref_kind is not None and _KIND.get(arr.dtype.kind) != ref_kind:
            raise ValueError(
                f"{who}: parameter {key!r} has dtype {arr.dtype}, the global model holds {np.asarray(ref).dtype}"
            )
        if finite and arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise ValueError(f"{who}: parameter {key!r} holds non-finite values")
        out[key] = arr
    return out
