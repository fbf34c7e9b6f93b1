"""Parameter geometry shared by the schemes: cosines, norms and the Gram matrix of client deltas.

Which arrays count (:func:`geometry_keys`): by default (``geometry="trainable"``) the trainable
floating-point parameters only. A state dict also holds buffers, which are not parameters of the
function the model computes but statistics of the data seen: BatchNorm's running mean and variance
move far more than the weights in one round (after a first local epoch of the compact DenseNet,
1 - cos over the whole state dict is 54 to 126 times 1 - cos over the parameters alone,
docs/methods.md) and would decide every cosine and distance.
A caller that holds the model names the buffers exactly (:func:`model_buffer_keys`, the keys of
``named_buffers()``, set on a scheme with :func:`use_model_buffers`); with a state dict alone the
rule is by name (:func:`is_buffer_name`: a last name component in :data:`BUFFER_NAMES`), which
gives the same set for every architecture of :mod:`fedweigh.models`. ``geometry="all"`` compares
every floating-point array of the state dict instead (integer buffers are never compared).

Every quantity is computed from three kinds of inner products over the compared arrays, with
Delta_k = theta_k - theta_g:

    A = ||theta_g||^2,   g_k = <theta_g, Delta_k>,   G_jk = <Delta_j, Delta_k>

so that, without forming theta_k again,

    cos(theta_k, theta_g) = (A + g_k) / sqrt(A (A + 2 g_k + G_kk)).

Raw-parameter cosines are all close to 1; computing them through Delta keeps their small differences
accurate (rounding is relative to ||Delta||, not to ||theta||). That is what makes float32 inner
products safe here: float32 inputs are multiplied in float32 (BLAS) in chunks of at most
``CHUNK`` elements and the chunk results are summed in float64; float64 inputs stay float64.

Cosine convention for zero vectors: cos(0, 0) = 1, cos(0, v) = 0 for v != 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from fedweigh.weighting.base import check_params_match

CHUNK = 1 << 20

GeometryMode = Literal["trainable", "all"]
GEOMETRY_MODES: tuple[str, ...] = ("trainable", "all")

#: Last name components of the buffers torch's normalisation layers keep in a state dict (BatchNorm's
#: running statistics and batch counter): the rule when no model names its buffers.
BUFFER_NAMES: tuple[str, ...] = ("running_mean", "running_var", "num_batches_tracked")


def float_keys(params: Mapping[str, np.ndarray]) -> list[str]:
    """Keys of the floating-point arrays, in dict order."""
    return [k for k, v in params.items() if np.issubdtype(np.asarray(v).dtype, np.floating)]


def is_buffer_name(key: str) -> bool:
    """Whether a state-dict key names a buffer by the name rule: its last component is in :data:`BUFFER_NAMES`."""
    return key.rpartition(".")[2] in BUFFER_NAMES


def model_buffer_keys(model: Any) -> frozenset[str]:
    """The state-dict keys of a torch module's buffers (``named_buffers()``), the exact set."""
    return frozenset(name for name, _ in model.named_buffers())


def check_geometry(geometry: object, *, scheme: str) -> None:
    """Raise ValueError naming the scheme unless ``geometry`` is one of :data:`GEOMETRY_MODES`."""
    if geometry not in GEOMETRY_MODES:
        raise ValueError(
            f"{scheme}: geometry must be 'trainable' (parameters only, buffers excluded) or 'all' "
            f"(every floating-point array), got {geometry!r}"
        )


def geometry_keys(
    params: Mapping[str, np.ndarray],
    geometry: str = "trainable",
    buffer_keys: Iterable[str] | None = None,
) -> list[str]:
    """The keys the geometry compares, in dict order.

    geometry "all": every floating-point array; "trainable": the floating-point arrays that are not
    buffers, ``buffer_keys`` when given (the model's exact set), else by :func:`is_buffer_name`.
    Raises ValueError when nothing is left to compare.
    """
    check_geometry(geometry, scheme="parameter geometry")
    keys = float_keys(params)
    if geometry == "trainable":
        if buffer_keys is None:
            keys = [k for k in keys if not is_buffer_name(k)]
        else:
            excluded = frozenset(buffer_keys)
            keys = [k for k in keys if k not in excluded]
    if not keys:
        raise ValueError(
            f"no floating-point {'parameters' if geometry == 'trainable' else 'arrays'} to compare"
        )
    return keys


@dataclass(kw_only=True)
class ParameterGeometry:
    """Mixin of the schemes that compare parameters (FedDRAW, FedAdp, IDA, FedAWA).

    geometry: "trainable" (default: parameters only, buffers excluded) or "all" (every
        floating-point array of the state dict, buffers included).
    buffer_keys: the exact buffer keys of the model (set by :func:`use_model_buffers` where the
        model is at hand); None: the name rule of :func:`is_buffer_name`. Not an option, not state.
    """

    geometry: GeometryMode = "trainable"
    buffer_keys: frozenset[str] | None = field(default=None, init=False, repr=False, compare=False)

    def compared_keys(self, params: Mapping[str, np.ndarray]) -> list[str]:
        """The keys of ``params`` this scheme's geometry compares (:func:`geometry_keys`)."""
        return geometry_keys(params, self.geometry, self.buffer_keys)


def use_model_buffers(scheme: object, model: Any) -> None:
    """Give a parameter-comparing scheme the exact buffer keys of ``model`` (a torch module); a no-op
    for other schemes or when ``model`` has no ``named_buffers``."""
    if isinstance(scheme, ParameterGeometry) and callable(getattr(model, "named_buffers", None)):
        scheme.buffer_keys = model_buffer_keys(model)


def _compute_dtype(arrays: Sequence[np.ndarray]) -> type[np.floating]:
    return np.float32 if all(np.asarray(a).dtype == np.float32 for a in arrays) else np.float64


def cosine_from_parts(a: np.ndarray, g: np.ndarray, c: np.ndarray) -> np.ndarray:
    """cos(theta_g, theta_g + Delta) from A = ||theta_g||^2, g = <theta_g, Delta>, c = ||Delta||^2.

    Element-wise over arrays of equal shape; zero-vector convention as in the module docstring.
    """
    a = np.asarray(a, dtype=np.float64)
    g = np.asarray(g, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    nk = np.maximum(a + 2.0 * g + c, 0.0)  # ||theta_k||^2
    denom = np.sqrt(a * nk)
    both_zero = (a <= 0) & (nk <= 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = np.where(denom > 0, (a + g) / np.where(denom > 0, denom, 1.0), np.where(both_zero, 1.0, 0.0))
    return np.clip(cos, -1.0, 1.0)


def cosine_from_gram(dot: np.ndarray, sq_a: np.ndarray, sq_b: np.ndarray) -> np.ndarray:
    """<a, b> / (||a|| ||b||) from inner products, with the zero-vector convention."""
    dot = np.asarray(dot, dtype=np.float64)
    denom = np.sqrt(np.maximum(sq_a, 0.0) * np.maximum(sq_b, 0.0))
    both_zero = (np.asarray(sq_a) <= 0) & (np.asarray(sq_b) <= 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = np.where(denom > 0, dot / np.where(denom > 0, denom, 1.0), np.where(both_zero, 1.0, 0.0))
    return np.clip(cos, -1.0, 1.0)


def layer_stats(
    params: Mapping[str, np.ndarray],
    global_params: Mapping[str, np.ndarray],
    *,
    name: str = "client",
    keys: Sequence[str] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per compared array l: (||theta_g,l||^2, <theta_g,l, Delta_l>, ||Delta_l||^2), float64.

    ``keys``: the arrays to compare (default: every floating-point array). Used by clients (to
    report their similarity under HE) and by the server alike.
    """
    check_params_match(name, params, global_params)
    keys = float_keys(global_params) if keys is None else list(keys)
    a = np.empty(len(keys))
    g = np.empty(len(keys))
    c = np.empty(len(keys))
    for i, key in enumerate(keys):
        gl = np.asarray(global_params[key])
        pl = np.asarray(params[key])
        dt = _compute_dtype((gl, pl))
        gv = gl.astype(dt, copy=False).ravel()
        dv = pl.astype(dt, copy=False).ravel() - gv
        a[i] = float(np.dot(gv, gv))
        g[i] = float(np.dot(gv, dv))
        c[i] = float(np.dot(dv, dv))
    if not (np.all(np.isfinite(g)) and np.all(np.isfinite(c))):
        raise ValueError(f"client {name!r}: parameters hold non-finite values")
    if not np.all(np.isfinite(a)):
        raise ValueError("global parameters hold non-finite values")
    return a, g, c


def model_similarity(
    params: Mapping[str, np.ndarray],
    global_params: Mapping[str, np.ndarray],
    mode: str = "params",
    *,
    name: str = "client",
    keys: Sequence[str] | None = None,
) -> float:
    """Cosine similarity between a client's and the global parameters over the arrays ``keys``
    (default: every floating-point array).

    mode "params": cos(vec theta_k, vec theta_g);
    mode "layer":  the mean over arrays l of cos(theta_k,l, theta_g,l).
    """
    a, g, c = layer_stats(params, global_params, name=name, keys=keys)
    if mode == "params":
        return float(cosine_from_parts(a.sum(), g.sum(), c.sum()))
    if mode == "layer":
        if a.size == 0:
            raise ValueError("no floating-point parameters to compare")
        return float(np.mean(cosine_from_parts(a, g, c)))
    raise ValueError(f"similarity mode must be 'params' or 'layer' here, got {mode!r}")


def direction_similarity(
    params: Mapping[str, np.ndarray],
    global_params: Mapping[str, np.ndarray],
    previous_global: Mapping[str, np.ndarray] | None,
    *,
    name: str = "client",
    keys: Sequence[str] | None = None,
) -> float:
    """cos(Delta_k, Delta_g^prev) with Delta_k = theta_k - theta_g^t, Delta_g^prev = theta_g^t - theta_g^{t-1}.

    The agreement of a client's update with the previous global update, over the arrays ``keys``
    (default: every floating-point array), in float64. Invariant to the length of the client's
    update (its number of local steps), unlike cos(theta_k, theta_g). No previous global model, or
    a zero previous update (the global model did not move), gives 0 for every client: no direction
    is known, so no client is preferred.
    """
    check_params_match(name, params, global_params)
    keys = float_keys(global_params) if keys is None else list(keys)
    if previous_global is None:
        return 0.0
    missing = [k for k in keys if k not in previous_global]
    if missing:
        raise ValueError(f"the previous global model lacks array(s) {missing[:3]} that the geometry compares")
    dot = prev_sq = own_sq = 0.0
    for key in keys:
        g = np.asarray(global_params[key], dtype=np.float64).ravel()
        before = np.asarray(previous_global[key], dtype=np.float64).ravel()
        if before.shape != g.shape:
            raise ValueError(
                f"the previous global model's array {key!r} has {before.size} values, not {g.size}"
            )
        step = g - before
        delta = np.asarray(params[key], dtype=np.float64).ravel() - g
        dot += float(np.dot(delta, step))
        prev_sq += float(np.dot(step, step))
        own_sq += float(np.dot(delta, delta))
    if not (math.isfinite(dot) and math.isfinite(own_sq)):
        raise ValueError(f"client {name!r}: parameters hold non-finite values")
    if not math.isfinite(prev_sq):
        raise ValueError("global parameters hold non-finite values")
    if prev_sq <= 0.0:
        return 0.0
    return float(cosine_from_gram(dot, own_sq, prev_sq))


def delta_norms(
    global_params: Mapping[str, np.ndarray], client_params: Sequence[Mapping[str, np.ndarray]]
) -> np.ndarray:
    """||theta_k,l - theta_g,l|| per client k (rows) and floating-point array l (columns, in
    :func:`float_keys` order), in float64.

    Unlike :func:`delta_gram` (BLAS in the arrays' precision) this never overflows for float32
    updates of any finite size: a norm is infinite only when it exceeds the float64 range.
    """
    keys = float_keys(global_params)
    out = np.zeros((len(client_params), len(keys)))
    with np.errstate(over="ignore", invalid="ignore"):
        for i, p in enumerate(client_params):
            for j, key in enumerate(keys):
                g = np.asarray(global_params[key], dtype=np.float64).ravel()
                d = np.asarray(p[key], dtype=np.float64).ravel() - g
                total = float(np.dot(d, d))
                out[i, j] = math.sqrt(total) if math.isfinite(total) else math.inf
    return out


def delta_gram64(
    global_params: Mapping[str, np.ndarray],
    client_params: Sequence[Mapping[str, np.ndarray]],
    *,
    chunk: int = CHUNK,
) -> np.ndarray:
    """G_jk = <Delta_j, Delta_k> over the floating-point arrays, accumulated in float64 (no float32
    overflow for large updates; an entry is infinite only beyond the float64 range)."""
    keys = float_keys(global_params)
    k = len(client_params)
    gram = np.zeros((k, k))
    with np.errstate(over="ignore", invalid="ignore"):
        for key in keys:
            g = np.asarray(global_params[key], dtype=np.float64).ravel()
            for start in range(0, g.size, chunk):
                seg = g[start : start + chunk]
                block = np.stack(
                    [
                        np.asarray(p[key], dtype=np.float64).ravel()[start : start + chunk] - seg
                        for p in client_params
                    ]
                )
                gram += block @ block.T
    return gram


@dataclass(frozen=True)
class DeltaGram:
    """Inner products of one round: A = ||theta_g||^2, g_k = <theta_g, Delta_k>, G_jk = <Delta_j, Delta_k>."""

    global_sq: float
    global_dot: np.ndarray
    gram: np.ndarray

    def param_cosines(self) -> np.ndarray:
        """cos(theta_k, theta_g) for every client."""
        return cosine_from_parts(
            np.full(self.global_dot.shape, self.global_sq), self.global_dot, np.diag(self.gram)
        )

    def delta_cosines(self, mix: np.ndarray) -> np.ndarray:
        """cos(Delta_k, sum_j mix_j Delta_j) for every client."""
        m = np.asarray(mix, dtype=np.float64)
        gm = self.gram @ m
        return cosine_from_gram(gm, np.diag(self.gram), np.full(gm.shape, float(m @ gm)))

    def distances_to_mix(self, mix: np.ndarray) -> np.ndarray:
        """||Delta_k - sum_j mix_j Delta_j|| = ||theta_k - sum_j mix_j theta_j|| when sum(mix) = 1."""
        m = np.asarray(mix, dtype=np.float64)
        gm = self.gram @ m
        return np.sqrt(np.maximum(np.diag(self.gram) - 2.0 * gm + float(m @ gm), 0.0))


def delta_gram(
    global_params: Mapping[str, np.ndarray],
    client_params: Sequence[Mapping[str, np.ndarray]],
    names: Sequence[str],
    *,
    chunk: int = CHUNK,
    keys: Sequence[str] | None = None,
) -> DeltaGram:
    """Build :class:`DeltaGram` over the arrays ``keys`` (default: every floating-point array) in one
    pass over the parameters (one (K+1) x chunk block at a time).

    Row 0 of each block holds theta_g, rows 1..K the deltas; the block's Gram matrix X X^T is
    computed by BLAS in the arrays' precision and accumulated in float64.
    """
    if len(client_params) != len(names):
        raise ValueError("one name per client parameter dict is required")
    for nm, p in zip(names, client_params, strict=True):
        check_params_match(nm, p, global_params)
    keys = float_keys(global_params) if keys is None else list(keys)
    arrays = [np.asarray(global_params[k]) for k in keys]
    arrays += [np.asarray(p[k]) for p in client_params for k in keys]
    dt = _compute_dtype(arrays)
    k_clients = len(client_params)
    total = np.zeros((k_clients + 1, k_clients + 1))  # float64
    sizes = [int(np.asarray(global_params[k]).size) for k in keys]
    width = max(1, min(chunk, sum(sizes)))
    block = np.empty((k_clients + 1, width), dtype=dt)
    pos = 0

    def flush(n: int) -> None:
        view = block[:, :n]
        total[...] += (view @ view.T).astype(np.float64)

    for key, size in zip(keys, sizes, strict=True):
        gv = np.asarray(global_params[key]).astype(dt, copy=False).ravel()
        start = 0
        while start < size:
            if pos == width:
                flush(pos)
                pos = 0
            take = min(size - start, width - pos)
            seg = gv[start : start + take]
            block[0, pos : pos + take] = seg
            for i, p in enumerate(client_params):
                pv = np.asarray(p[key]).ravel()[start : start + take]
                np.subtract(pv, seg, out=block[i + 1, pos : pos + take])  # casting: same_kind (the default)
            pos += take
            start += take
    if pos:
        flush(pos)
    if not np.isfinite(total[0, 0]):
        raise ValueError("global parameters hold non-finite values")
    diag = np.diag(total)[1:]
    for nm, v in zip(names, diag, strict=True):
        if not np.isfinite(v):
            raise ValueError(f"client {nm!r}: parameters hold non-finite values")
    return DeltaGram(global_sq=float(total[0, 0]), global_dot=total[0, 1:].copy(), gram=total[1:, 1:].copy())
