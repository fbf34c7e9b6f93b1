"""Parameter geometry shared by the schemes: cosines, norms and the Gram matrix of client deltas.

Every quantity is computed from three kinds of inner products over the floating-point arrays of a
state dict (integer buffers such as ``num_batches_tracked`` are ignored), with
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedweigh.weighting.base import check_params_match

CHUNK = 1 << 20


def float_keys(params: Mapping[str, np.ndarray]) -> list[str]:
    """Keys of the floating-point arrays, in dict order."""
    return [k for k, v in params.items() if np.issubdtype(np.asarray(v).dtype, np.floating)]


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
    params: Mapping[str, np.ndarray], global_params: Mapping[str, np.ndarray], *, name: str = "client"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per floating-point array l: (||theta_g,l||^2, <theta_g,l, Delta_l>, ||Delta_l||^2), float64.

    Used by clients (to report their similarity under HE) and by the server alike.
    """
    check_params_match(name, params, global_params)
    keys = float_keys(global_params)
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
) -> float:
    """Cosine similarity between a client's and the global parameters.

    mode "params": cos(vec theta_k, vec theta_g) over all floating-point arrays;
    mode "layer":  the mean over floating-point arrays l of cos(theta_k,l, theta_g,l).
    """
    a, g, c = layer_stats(params, global_params, name=name)
    if mode == "params":
        return float(cosine_from_parts(a.sum(), g.sum(), c.sum()))
    if mode == "layer":
        if a.size == 0:
            raise ValueError("no floating-point parameters to compare")
        return float(np.mean(cosine_from_parts(a, g, c)))
    raise ValueError(f"similarity mode must be 'params' or 'layer' here, got {mode!r}")


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
) -> DeltaGram:
    """Build :class:`DeltaGram` in one pass over the parameters (one (K+1) x chunk block at a time).

    Row 0 of each block holds theta_g, rows 1..K the deltas; the block's Gram matrix X X^T is
    computed by BLAS in the arrays' precision and accumulated in float64.
    """
    if len(client_params) != len(names):
        raise ValueError("one name per client parameter dict is required")
    for nm, p in zip(names, client_params, strict=True):
        check_params_match(nm, p, global_params)
    keys = float_keys(global_params)
    arrays = [np.asarray(global_params[k]) for k in keys]
    arrays += [np.asarray(p[k]) for p in client_params for k in keys]
    dt = _compute_dtype(arrays)
    k_clients = len(client_params)
    total = np.zeros((k_clients + 1, k_clients + 1), dtype=np.float64)
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
                np.subtract(pv, seg, out=block[i + 1, pos : pos + take], casting="same_kind")
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
