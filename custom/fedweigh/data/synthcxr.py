"""SynthCXR: a deterministic synthetic chest-radiograph dataset with the 14 ChestMNIST findings.

Each image is a grayscale PA-chest-like radiograph (lung fields, mediastinum and heart shadow,
spine, ribs, clavicles, diaphragm domes) with per-patient variability in position, size, slight
rotation, tissue density and brightness. Labels are sampled first, then rendered:

* Labels: a latent Gaussian factor model (a Gaussian copula). For finding k,
  ``z_k = sum_j L_kj f_j + sqrt(1 - sum_j L_kj^2) e_k`` with independent standard normal disease-process
  factors ``f_j`` (general, cardiac/fluid, infection, neoplastic, chronic) and noise ``e_k``; the label
  is ``z_k > Phi^{-1}(1 - p_k)``, so the marginal prevalence is exactly ``p_k`` in expectation and
  findings that share a factor co-occur. ``p_k`` are the NIH ChestX-ray14 frequencies
  (Wang et al., CVPR 2017, 112,120 images), the source of ChestMNIST.
* Images: every finding has its own visual pattern (see ``FINDING_PATTERNS``) drawn with numpy on
  precomputed coordinate grids, vectorised over blocks of patients.

Determinism: patients are drawn in fixed blocks of ``_BLOCK`` rows, each from its own
``numpy.random.Generator`` seeded by ``(seed, stream, block)``, so ``generate_synthcxr(n, size, seed)``
is bit-identical across calls, and the first m rows do not depend on n. Per-patient anatomy and labels
do not depend on ``size`` either (only the pixel noise does), so 32 px and 64 px show the same patients.
Per-hospital acquisition shift is not applied here (the scenario code applies it).
"""

from __future__ import annotations

import os
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from statistics import NormalDist

import numpy as np

from fedweigh.data.base import CHEST_FINDINGS, LabeledImages
from fedweigh.io import atomic_write_npz, write_figure

SYNTHCXR_DEFAULT_SIZE = 32
#: Bumped whenever the rendered pixels or sampled labels change; part of the cache file name.
SYNTHCXR_VERSION = 2
MIN_SIZE = 28
_BLOCK = 512

#: Target marginal prevalence per finding: NIH ChestX-ray14 label frequencies (Wang et al. 2017).
PREVALENCE: dict[str, float] = {
    "atelectasis": 0.103,
    "cardiomegaly": 0.025,
    "effusion": 0.119,
    "infiltration": 0.177,
    "mass": 0.052,
    "nodule": 0.056,
    "pneumonia": 0.013,
    "pneumothorax": 0.047,
    "consolidation": 0.042,
    "edema": 0.021,
    "emphysema": 0.022,
    "fibrosis": 0.015,
    "pleural": 0.030,
    "hernia": 0.002,
}

#: Latent disease-process factors of the label copula.
LATENT_FACTORS: tuple[str, ...] = ("general", "cardiac", "infection", "neoplastic", "chronic")

#: Loadings L_kj of each finding on ``LATENT_FACTORS`` (row sums of squares < 1).
FACTOR_LOADINGS: dict[str, tuple[float, float, float, float, float]] = {
    "atelectasis": (0.40, 0.30, 0.35, 0.00, 0.00),
    "cardiomegaly": (0.35, 0.60, 0.00, 0.00, 0.00),
    "effusion": (0.40, 0.55, 0.25, 0.00, 0.00),
    "infiltration": (0.40, 0.00, 0.45, 0.00, 0.00),
    "mass": (0.35, 0.00, 0.00, 0.65, 0.00),
    "nodule": (0.35, 0.00, 0.00, 0.60, 0.00),
    "pneumonia": (0.35, 0.00, 0.65, 0.00, 0.00),
    "pneumothorax": (0.40, 0.00, 0.00, 0.00, 0.20),
    "consolidation": (0.40, 0.00, 0.60, 0.00, 0.00),
    "edema": (0.35, 0.55, 0.20, 0.00, 0.00),
    "emphysema": (0.35, 0.00, 0.00, 0.00, 0.50),
    "fibrosis": (0.35, 0.00, 0.00, 0.00, 0.55),
    "pleural": (0.35, 0.00, 0.00, 0.20, 0.45),
    "hernia": (0.35, 0.00, 0.00, 0.00, 0.00),
}

#: The visual pattern each finding draws (also the table in docs/synthcxr.md).
FINDING_PATTERNS: dict[str, str] = {
    "atelectasis": "linear band opacity in a mid/lower lung with volume loss (elevated hemidiaphragm, "
    "mediastinum shifted towards it)",
    "cardiomegaly": "heart shadow widened (cardiothoracic ratio up) and displaced to the patient's left",
    "effusion": "dense fluid filling a lung base with a meniscus rising laterally; blunted costophrenic "
    "angle, one or both sides",
    "infiltration": "ill-defined patchy opacities in one zone (upper/mid/lower), one or both lungs",
    "mass": "large (about 1/4 lung width) lobulated dense round opacity",
    "nodule": "one or two small (about 1 px sigma at 32 px) bright round spots",
    "pneumonia": "dense patchy lower-zone opacity crossed by dark air-bronchogram stripes",
    "pneumothorax": "apical/lateral hyperlucent rim without lung markings, thin bright visceral pleural "
    "line, collapsed lung",
    "consolidation": "homogeneous dense lobar opacity with a sharp straight fissure border (upper or "
    "middle zone)",
    "edema": "bilateral symmetric perihilar haze (bat-wing)",
    "emphysema": "hyperlucent enlarged lungs, fewer markings, low flattened diaphragm, narrow heart",
    "fibrosis": "bilateral reticular (net-like) lines in the periphery and lower zones, smaller lungs",
    "pleural": "smooth bright rim along the lateral chest wall and apex, one or both sides",
    "hernia": "rounded retrocardiac opacity above the diaphragm with an air-fluid level (dark cap)",
}

_ABBREVIATIONS: dict[str, str] = {
    "atelectasis": "Atel",
    "cardiomegaly": "Card",
    "effusion": "Eff",
    "infiltration": "Inf",
    "mass": "Mass",
    "nodule": "Nod",
    "pneumonia": "Pna",
    "pneumothorax": "Ptx",
    "consolidation": "Cons",
    "edema": "Edema",
    "emphysema": "Emph",
    "fibrosis": "Fib",
    "pleural": "Pleu",
    "hernia": "Hern",
}

# Per-patient uniform(0, 1) draws, one column each. Every column is drawn for every patient whatever
# the labels, so the random stream (and hence the anatomy) never depends on the labels.
_PARAMS: tuple[str, ...] = (
    # anatomy
    "scale", "rot", "shift_x", "shift_y", "lung_dx", "lung_dy", "lung_a", "lung_b", "dome", "dome_c",
    "heart_x", "heart_y", "heart_a", "heart_b", "air", "tissue", "rib_phase", "rib_period",
    "spine_phase", "bright", "offset",
    # findings
    "atel_side", "atel_y", "atel_angle", "atel_width",
    "eff_side", "eff_bilat", "eff_height",
    "inf_zone", "inf_side", "inf_bilat", "inf_thr",
    "mass_side", "mass_x", "mass_y", "mass_r", "mass_lobe",
    "nod_count", "nod_side1", "nod_x1", "nod_y1", "nod_side2", "nod_x2", "nod_y2",
    "pna_side", "pna_x", "pna_y", "pna_angle",
    "ptx_side",
    "cons_side", "cons_lobe", "cons_tilt",
    "pl_side", "pl_bilat", "pl_thick",
    "hernia_x", "hernia_r", "hernia_level",
    # one severity draw per finding
    *(f"sev_{f}" for f in CHEST_FINDINGS),
)  # fmt: skip
_PARAM_INDEX = {name: i for i, name in enumerate(_PARAMS)}
# Smooth unit-variance Gaussian random fields: standard normal values on a G x G control grid, upsampled
# to the image by Gaussian-RBF interpolation (coarse: markings and patchy opacities; fine: reticulation).
_COARSE_FIELDS: tuple[str, ...] = ("markings", "infiltrate", "pneumonia")
_COARSE_GRID = 7
_FINE_FIELDS: tuple[str, ...] = ("reticular",)
_FINE_GRID = 14
_PIXEL_NOISE = 0.012

# Per finding (strength, minimum severity). A positive patient's severity is s ~ U(min, 1) and the
# pattern's amplitude is strength * s: for opacities the fraction of lung air replaced, for nodule and
# hernia an intensity added, for pneumothorax the extra air, for cardiomegaly the relative heart
# widening, for emphysema the scale of all its changes, for atelectasis the band opacity.
_SEVERITY: dict[str, tuple[float, float]] = {
    "atelectasis": (0.80, 0.30),
    "cardiomegaly": (0.32, 0.30),
    "effusion": (0.75, 0.35),
    "infiltration": (0.60, 0.50),
    "mass": (0.80, 0.35),
    "nodule": (0.32, 0.60),
    "pneumonia": (0.90, 0.60),
    "pneumothorax": (0.20, 0.40),
    "consolidation": (0.65, 0.30),
    "edema": (0.50, 0.30),
    "emphysema": (0.70, 0.25),
    "fibrosis": (0.70, 0.55),
    "pleural": (0.75, 0.30),
    "hernia": (0.50, 0.60),
}


def _validate(n: int, size: int, seed: int) -> None:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"SynthCXR: n must be a non-negative int, got {n!r}")
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < MIN_SIZE:
        raise ValueError(f"SynthCXR: size must be an int >= {MIN_SIZE} pixels, got {size!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"SynthCXR: seed must be a non-negative int, got {seed!r}")


# ---------------------------------------------------------------------------------------------- labels


def _loading_matrix() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(L (14, F), unique sd (14,), thresholds Phi^{-1}(1 - p) (14,)) in CHEST_FINDINGS order."""
    loadings = np.array([FACTOR_LOADINGS[f] for f in CHEST_FINDINGS], dtype=np.float64)
    shared = (loadings**2).sum(axis=1)
    if np.any(shared >= 1.0):
        raise ValueError("SynthCXR: FACTOR_LOADINGS rows must have a sum of squares below 1")
    thresholds = np.array([NormalDist().inv_cdf(1.0 - PREVALENCE[f]) for f in CHEST_FINDINGS])
    return loadings, np.sqrt(1.0 - shared), thresholds


def _label_block(seed: int, block: int) -> np.ndarray:
    loadings, unique_sd, thresholds = _loading_matrix()
    rng = np.random.default_rng([seed, 0, block])
    factors = rng.standard_normal((_BLOCK, loadings.shape[1]))
    noise = rng.standard_normal((_BLOCK, loadings.shape[0]))
    latent = factors @ loadings.T + noise * unique_sd
    return (latent > thresholds).astype(np.float32)


def sample_synthcxr_labels(n: int, seed: int = 0) -> np.ndarray:
    """The (n, 14) float32 0/1 labels ``generate_synthcxr(n, size, seed)`` renders (any size); cheap."""
    _validate(n, MIN_SIZE, seed)
    n_blocks = -(-n // _BLOCK)
    out = np.empty((n_blocks * _BLOCK, len(CHEST_FINDINGS)), dtype=np.float32)
    for b in range(n_blocks):
        out[b * _BLOCK : (b + 1) * _BLOCK] = _label_block(seed, b)
    return out[:n].copy()


# ---------------------------------------------------------------------------------------------- images


def _sig(x: np.ndarray) -> np.ndarray:
    """Logistic sigmoid 1 / (1 + exp(-x)), computed as 0.5 + 0.5 tanh(x / 2) (overflow-free)."""
    return np.float32(0.5) + np.float32(0.5) * np.tanh(np.float32(0.5) * x)


@lru_cache(maxsize=8)
def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel-centre coordinates in [-1, 1]: x to the image right, y downwards; shapes (1, 1, S) and (1, S, 1)."""
    c = ((np.arange(size, dtype=np.float32) + 0.5) / size * 2.0 - 1.0).astype(np.float32)
    return c.reshape(1, 1, size), c.reshape(1, size, 1)


@lru_cache(maxsize=16)
def _upsampler(size: int, grid: int) -> tuple[np.ndarray, np.ndarray]:
    """RBF interpolation matrix W (S, G) and the per-pixel sd of W F W^T for iid N(0,1) F, (S, S)."""
    x = (np.arange(size) + 0.5) / size * 2.0 - 1.0
    centres = np.linspace(-1.15, 1.15, grid)
    spacing = centres[1] - centres[0]
    w = np.exp(-((x[:, None] - centres[None, :]) ** 2) / (2.0 * (0.75 * spacing) ** 2))
    row_sq = (w**2).sum(axis=1)
    sd = np.sqrt(row_sq[:, None] * row_sq[None, :])
    return w.astype(np.float32), sd.astype(np.float32)


def _field(raw: np.ndarray, size: int) -> np.ndarray:
    """Smooth unit-variance field (B, S, S) from control values raw (B, G, G): W raw W^T / sd."""
    w, sd = _upsampler(size, raw.shape[-1])
    return np.matmul(np.matmul(w, raw), w.T) / sd


def _ellipse(
    u: np.ndarray, v: np.ndarray, cx: np.ndarray, cy: np.ndarray, a: np.ndarray, b: np.ndarray, eps: float
) -> np.ndarray:
    """Soft inside-mask of an ellipse: sigmoid((1 - q^2) r / (2 eps)), q^2 = ((u-cx)/a)^2 + ((v-cy)/b)^2.

    Near the border (1 - q^2) / 2 * r approximates the signed distance for r = min(a, b).
    """
    q2 = ((u - cx) / a) ** 2 + ((v - cy) / b) ** 2
    return _sig((1.0 - q2) * (np.minimum(a, b) / (2.0 * eps)))


def _col(x: np.ndarray) -> np.ndarray:
    """(B,) -> (B, 1, 1) float32 for broadcasting over pixels."""
    return np.asarray(x, dtype=np.float32).reshape(-1, 1, 1)


def _pick(side: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Per row, ``left`` where side < 0 (image left = patient's right lung) else ``right``."""
    return np.where(side.reshape(-1, *([1] * (left.ndim - 1))) < 0, left, right)


@dataclass
class _Block:
    """One block of patients being rendered: per-patient parameters and geometry, the patient coordinates
    (u, v) of every pixel, lung masks, and the accumulators the finding painters add to."""

    p: np.ndarray  # (B, len(_PARAMS)) uniform(0, 1) draws
    coarse: np.ndarray  # (B, len(_COARSE_FIELDS), G, G) standard normal control values
    fine: np.ndarray  # (B, len(_FINE_FIELDS), G', G')
    size: int
    eps: float  # soft-edge width in patient units (0.4 px)
    sev: dict[str, np.ndarray]  # (B,) severity in [min, 1] for positives, 0 for negatives
    amp: dict[str, np.ndarray]  # (B,) strength * severity
    lung_cx: np.ndarray  # (B,) |x| of both lung centres
    lung_cy: np.ndarray
    lung_a: np.ndarray  # half-width
    lung_b: np.ndarray  # half-height
    dome: np.ndarray  # (B,) mean diaphragm dome height
    dome_side: dict[int, np.ndarray]  # per side (-1 image left, +1 image right)
    u: np.ndarray = field(default_factory=lambda: np.empty(0, np.float32))  # (B, S, S)
    v: np.ndarray = field(default_factory=lambda: np.empty(0, np.float32))
    lung: dict[int, np.ndarray] = field(default_factory=dict)  # (B, S, S) soft masks without mediastinum
    opacity: np.ndarray = field(default_factory=lambda: np.empty(0, np.float32))  # air fraction replaced
    air_mult: np.ndarray = field(default_factory=lambda: np.empty(0, np.float32))  # extra air (lucency)
    direct: np.ndarray = field(default_factory=lambda: np.empty(0, np.float32))  # intensity added

    def __getitem__(self, name: str) -> np.ndarray:
        return self.p[:, _PARAM_INDEX[name]]

    def side(self, name: str) -> np.ndarray:
        """-1 (image left, patient's right) or +1 (image right) from a uniform column."""
        return np.where(self[name] < 0.5, -1.0, 1.0).astype(np.float32)

    def lung_of(self, side: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """Rows ``idx`` of the lung mask on ``side`` (one side per row)."""
        return _pick(side, self.lung[-1][idx], self.lung[1][idx])

    def both(self, idx: np.ndarray) -> np.ndarray:
        return self.lung[-1][idx] + self.lung[1][idx]


def _geometry(p: np.ndarray, labels: np.ndarray, coarse: np.ndarray, fine: np.ndarray, size: int) -> _Block:
    """Per-patient anatomy parameters, with the finding-driven changes (volume loss, enlargement)."""
    has = {f: (labels[:, k] > 0.5).astype(np.float32) for k, f in enumerate(CHEST_FINDINGS)}
    col = {name: p[:, i] for name, i in _PARAM_INDEX.items()}
    sev = {}
    for f in CHEST_FINDINGS:
        low = _SEVERITY[f][1]
        sev[f] = (low + (1.0 - low) * col[f"sev_{f}"]).astype(np.float32) * has[f]
    amp = {f: _SEVERITY[f][0] * sev[f] for f in CHEST_FINDINGS}
    emph = amp["emphysema"]
    atel_side = np.where(col["atel_side"] < 0.5, -1.0, 1.0).astype(np.float32)
    lung_a = 0.30 * (1.0 + 0.12 * (col["lung_a"] - 0.5))
    lung_b = 0.62 * (1.0 + 0.10 * (col["lung_b"] - 0.5))
    lung_a = lung_a * (1.0 + 0.10 * emph) * (1.0 - 0.06 * has["fibrosis"])
    lung_b = lung_b * (1.0 + 0.12 * emph) * (1.0 - 0.07 * has["fibrosis"])
    dome = 0.42 + 0.06 * (col["dome"] - 0.5) + 0.12 * emph
    # Patient's right dome (image left) sits higher than the left; atelectasis elevates its side.
    dome_side = {
        -1: dome - 0.03 - 0.10 * sev["atelectasis"] * (atel_side < 0),
        1: dome + 0.03 - 0.10 * sev["atelectasis"] * (atel_side > 0),
    }
    return _Block(
        p=p,
        coarse=coarse,
        fine=fine,
        size=size,
        eps=0.8 / size,
        sev=sev,
        amp=amp,
        lung_cx=0.40 + 0.04 * (col["lung_dx"] - 0.5),
        lung_cy=-0.06 + 0.06 * (col["lung_dy"] - 0.5) + 0.04 * emph,
        lung_a=lung_a,
        lung_b=lung_b,
        dome=dome,
        dome_side=dome_side,
    )


def _pose(b: _Block) -> None:
    """Patient coordinates (u, v) of every pixel: per-patient shift, rotation and scale of the grid."""
    gx, gy = _grid(b.size)
    scale = _col(0.95 + 0.10 * b["scale"])
    rot = 0.10 * (b["rot"] - 0.5)
    cos, sin = _col(np.cos(rot)), _col(np.sin(rot))
    xs = gx - _col(0.10 * (b["shift_x"] - 0.5))
    ys = gy - _col(0.10 * (b["shift_y"] - 0.5))
    b.u = ((cos * xs + sin * ys) / scale).astype(np.float32)
    b.v = ((cos * ys - sin * xs) / scale).astype(np.float32)


def _anatomy(b: _Block) -> np.ndarray:
    """Body, heart and mediastinum, lungs, bones and lung markings; returns the image without lung air.

    Sets ``b.lung`` and initialises the accumulators (markings go into ``b.opacity``).
    """
    f32 = np.float32
    u, v, eps = b.u, b.v, b.eps
    sev, emph = b.sev, b.amp["emphysema"]
    body = _ellipse(u, v, f32(0.0), f32(0.15), f32(0.95), f32(1.15), eps)
    tissue = _col(0.58 + 0.06 * (b["tissue"] - 0.5)) + f32(0.05) * v
    img = f32(0.06) + (tissue - f32(0.06)) * body

    atel_side = b.side("atel_side")
    heart_cx = 0.08 + 0.04 * (b["heart_x"] - 0.5) + 0.04 * sev["atelectasis"] * atel_side
    heart_cx = heart_cx + 0.06 * sev["cardiomegaly"]
    heart_cy = 0.30 + 0.04 * (b["heart_y"] - 0.5)
    heart_a = 0.26 * (1.0 + 0.14 * (b["heart_a"] - 0.5)) * (1.0 + b.amp["cardiomegaly"]) * (1.0 - 0.15 * emph)
    heart_b = 0.20 * (1.0 + 0.10 * (b["heart_b"] - 0.5)) * (1.0 + 0.15 * sev["cardiomegaly"])
    heart = _ellipse(u, v, _col(heart_cx), _col(heart_cy), _col(heart_a), _col(heart_b), eps)
    knob = _ellipse(u, v, f32(0.12), f32(-0.22), f32(0.08), f32(0.08), eps)
    not_mediastinum = (1.0 - heart) * (1.0 - knob)
    img = img + f32(0.04) * heart

    dome_c = (1.0 + 0.2 * (b["dome_c"] - 0.5)) * (1.0 - 0.7 * emph)
    lung_full = {}
    for s in (-1, 1):
        cx = _col(s * b.lung_cx)
        below_dome = _sig((_col(b.dome_side[s]) + _col(dome_c) * (u - cx) ** 2 - v) / eps)
        lung_full[s] = _ellipse(u, v, cx, _col(b.lung_cy), _col(b.lung_a), _col(b.lung_b), eps) * below_dome
    b.lung = {s: lung_full[s] * not_mediastinum for s in (-1, 1)}

    # bones: spine with vertebrae, clavicles, ribs over the lungs
    spine = _sig((0.085 - np.abs(u)) / eps) * (
        f32(0.8) + f32(0.2) * np.cos(2 * np.pi * v / f32(0.17) + _col(2 * np.pi * b["spine_phase"]))
    )
    clavicle = np.exp(-(((v + 0.70 - 0.12 * np.abs(u)) / 0.04) ** 2)) * _sig((0.75 - np.abs(u)) / eps)
    period = _col(0.23 + 0.02 * b["rib_period"])
    rib_t = v - f32(0.25) * np.abs(u) + f32(0.35) * u**2
    ribs = (f32(0.5) + f32(0.5) * np.cos(2 * np.pi * rib_t / period + _col(2 * np.pi * b["rib_phase"]))) ** 2
    img = img + (
        f32(0.08) * spine + f32(0.08) * clavicle * body + f32(0.06) * ribs * (lung_full[-1] + lung_full[1])
    )

    # lung opacity (fraction of air replaced) and air multiplier; markings densest near the hila
    markings = np.maximum(_field(b.coarse[:, 0], b.size), 0.0)
    hilar = np.exp(-((np.abs(u) - 0.22) ** 2 + (v - 0.02) ** 2) / f32(0.18))
    b.opacity = markings * (f32(0.06) + f32(0.14) * hilar) * (1.0 - 0.6 * _col(emph))
    b.air_mult = np.ones_like(u) * (1.0 + 0.25 * _col(emph))
    b.direct = np.zeros_like(u)
    return img


# --- finding painters: each adds its pattern for the positive rows ``i`` to the block's accumulators ---


def _paint_atelectasis(b: _Block, i: np.ndarray) -> None:
    s = b.side("atel_side")[i]
    uu, vv = b.u[i], b.v[i]
    y0 = _col(0.05 + 0.20 * b["atel_y"][i])
    ang = _col(0.7 * (b["atel_angle"][i] - 0.5))
    width = _col(0.035 + 0.02 * b["atel_width"][i])
    dist = (vv - y0) * np.cos(ang) - (uu - _col(s * b.lung_cx[i])) * np.sin(ang)
    band = _sig((width - np.abs(dist)) / b.eps)
    b.opacity[i] += _col(b.amp["atelectasis"][i]) * band * b.lung_of(s, i)


def _paint_effusion(b: _Block, i: np.ndarray) -> None:
    f32 = np.float32
    s = b.side("eff_side")[i]
    bilateral = b["eff_bilat"][i] < 0.4
    uu, vv = b.u[i], b.v[i]
    h = _col(0.16 + 0.18 * b["eff_height"][i])
    for side in (-1, 1):
        on = _col((s == side) | bilateral)
        lateral = np.clip((side * (uu - _col(side * b.lung_cx[i])) / _col(b.lung_a[i]) + 1.0) / 2.0, 0.0, 1.0)
        level = _col(b.dome_side[side][i]) + f32(0.04) - h * (f32(0.3) + f32(0.7) * lateral**1.5)
        fluid = _sig((vv - level) / (2 * b.eps))
        b.opacity[i] += _col(b.amp["effusion"][i]) * on * fluid * b.lung[side][i]


def _paint_infiltration(b: _Block, i: np.ndarray) -> None:
    vv = b.v[i]
    s = b.side("inf_side")[i]
    bilateral = b["inf_bilat"][i] < 0.6
    zone = _col(np.choose(np.minimum((b["inf_zone"][i] * 3).astype(int), 2), [-0.30, 0.02, 0.28]))
    region = np.exp(-(((vv - zone) / 0.25) ** 2)) * np.where(_col(bilateral), b.both(i), b.lung_of(s, i))
    # patches: where the field comes within 0.8-1.6 sd of its maximum inside the region
    fld = _field(b.coarse[i, 1], b.size)
    peak = np.where(region > 0.3, fld, -np.inf).max(axis=(1, 2), keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    patches = _sig((fld - peak + _col(0.8 + 0.8 * b["inf_thr"][i])) / 0.25)
    b.opacity[i] += _col(b.amp["infiltration"][i]) * patches * region


def _paint_mass(b: _Block, i: np.ndarray) -> None:
    uu, vv = b.u[i], b.v[i]
    s = b.side("mass_side")[i]
    cx = _col(s * b.lung_cx[i] + 0.5 * b.lung_a[i] * (2 * b["mass_x"][i] - 1))
    cy = _col(b.lung_cy[i] + 0.45 * b.lung_b[i] * (2 * b["mass_y"][i] - 1))
    r = _col(0.10 + 0.06 * b["mass_r"][i])
    angle = np.arctan2(vv - cy, uu - cx)
    r_eff = r * (1.0 + 0.12 * np.cos(3 * angle + _col(2 * np.pi * b["mass_lobe"][i])))
    d = np.sqrt((uu - cx) ** 2 + (vv - cy) ** 2)
    b.opacity[i] += _col(b.amp["mass"][i]) * _sig((r_eff - d) / b.eps)


def _paint_nodule(b: _Block, i: np.ndarray) -> None:
    uu, vv = b.u[i], b.v[i]
    sigma = np.float32(0.05)
    for k, present in ((1, np.ones(i.size, bool)), (2, b["nod_count"][i] < 0.35)):
        s = b.side(f"nod_side{k}")[i]
        cx = _col(s * b.lung_cx[i] + 0.55 * b.lung_a[i] * (2 * b[f"nod_x{k}"][i] - 1))
        cy = _col(b.lung_cy[i] + 0.50 * b.lung_b[i] * (2 * b[f"nod_y{k}"][i] - 1))
        blob = np.exp(-((uu - cx) ** 2 + (vv - cy) ** 2) / (2 * sigma**2))
        b.direct[i] += _col(b.amp["nodule"][i]) * _col(present) * blob


def _paint_pneumonia(b: _Block, i: np.ndarray) -> None:
    f32 = np.float32
    uu, vv = b.u[i], b.v[i]
    s = b.side("pna_side")[i]
    cx = _col(s * (b.lung_cx[i] + 0.04 + 0.06 * (b["pna_x"][i] - 0.5)))
    cy = _col(0.20 + 0.08 * b["pna_y"][i])
    region = _ellipse(uu, vv, cx, cy, f32(0.21), f32(0.17), 3 * b.eps)
    patchy = f32(0.7) + f32(0.3) * _sig(_field(b.coarse[i, 2], b.size) / 0.5)
    ang = _col(np.pi * b["pna_angle"][i])
    stripes = (f32(0.5) + f32(0.5) * np.cos(2 * np.pi * (uu * np.cos(ang) + vv * np.sin(ang)) / 0.16)) ** 4
    b.opacity[i] += _col(b.amp["pneumonia"][i]) * region * (patchy - f32(0.45) * stripes) * b.lung_of(s, i)


def _paint_consolidation(b: _Block, i: np.ndarray) -> None:
    f32 = np.float32
    uu, vv = b.u[i], b.v[i]
    s = b.side("cons_side")[i]
    tilt = _col(0.5 * (b["cons_tilt"][i] - 0.5))
    rel = uu - _col(s * b.lung_cx[i])
    upper = _col(b["cons_lobe"][i] < 0.6)
    fissure1 = f32(0.0) + tilt * rel
    fissure2 = f32(0.30) + tilt * rel
    above1 = _sig((fissure1 - vv) / b.eps)
    middle = _sig((vv - fissure1) / b.eps) * _sig((fissure2 - vv) / b.eps)
    region = np.where(upper, above1, middle)
    b.opacity[i] += _col(b.amp["consolidation"][i]) * region * b.lung_of(s, i)


def _paint_edema(b: _Block, i: np.ndarray) -> None:
    uu, vv = b.u[i], b.v[i]
    batwing = np.exp(-(((np.abs(uu) - 0.22) / 0.15) ** 2 + ((vv - 0.05) / 0.25) ** 2) / 2)
    b.opacity[i] += _col(b.amp["edema"][i]) * batwing * b.both(i)


def _paint_fibrosis(b: _Block, i: np.ndarray) -> None:
    f32 = np.float32
    uu, vv = b.u[i], b.v[i]
    net = np.exp(-((_field(b.fine[i, 0], b.size) / 0.35) ** 2))
    q = np.sqrt(
        ((np.abs(uu) - _col(b.lung_cx[i])) / _col(b.lung_a[i])) ** 2
        + ((vv - _col(b.lung_cy[i])) / _col(b.lung_b[i])) ** 2
    )
    periphery = _sig((q - 0.5) / 0.1) * (f32(0.5) + f32(0.5) * _sig(vv / 0.2))
    b.opacity[i] += _col(b.amp["fibrosis"][i]) * net * periphery * b.both(i)


def _paint_pleural(b: _Block, i: np.ndarray) -> None:
    uu, vv = b.u[i], b.v[i]
    s = b.side("pl_side")[i]
    bilateral = b["pl_bilat"][i] < 0.4
    t = _col(0.08 + 0.05 * b["pl_thick"][i])
    a, bb, cy = _col(b.lung_a[i]), _col(b.lung_b[i]), _col(b.lung_cy[i])
    for side in (-1, 1):
        on = _col((s == side) | bilateral)
        cx = _col(side * b.lung_cx[i]) - side * t / 2
        inner = _ellipse(uu, vv, cx, cy + t / 2, a - t / 2, bb - t / 2, b.eps)
        b.opacity[i] += _col(b.amp["pleural"][i]) * on * b.lung[side][i] * (1.0 - inner)


def _paint_hernia(b: _Block, i: np.ndarray) -> None:
    f32 = np.float32
    uu, vv = b.u[i], b.v[i]
    r = _col(0.14 + 0.05 * b["hernia_r"][i])
    cx = _col(0.02 + 0.08 * (b["hernia_x"][i] - 0.5))
    cy = _col(b.dome[i]) - r * 0.6
    disk = _ellipse(uu, vv, cx, cy, r, r, b.eps)
    level = cy - r * _col(0.1 + 0.3 * b["hernia_level"][i])
    gas = _sig((level - vv) / b.eps)
    b.direct[i] += _col(b.amp["hernia"][i]) * disk * (f32(0.4) - f32(1.3) * gas)


def _paint_pneumothorax(b: _Block, i: np.ndarray) -> None:
    """Runs last: the rim beyond the collapsed lung loses its markings and any other opacity."""
    uu, vv = b.u[i], b.v[i]
    s = b.side("ptx_side")[i]
    frac = 0.10 + 0.25 * b.sev["pneumothorax"][i]
    a, bb = b.lung_a[i], b.lung_b[i]
    a_c, b_c = _col(a * (1 - frac)), _col(bb * (1 - 0.6 * frac))
    cx = _col(s * (b.lung_cx[i] - a * frac))
    cy = _col(b.lung_cy[i] + 0.6 * bb * frac)
    collapsed = _ellipse(uu, vv, cx, cy, a_c, b_c, b.eps)
    side_lung = b.lung_of(s, i)
    rim = side_lung * (1.0 - collapsed)
    q = np.sqrt(((uu - cx) / a_c) ** 2 + ((vv - cy) / b_c) ** 2)
    pleural_line = np.exp(-((((q - 1.0) * np.minimum(a_c, b_c)) / (1.2 / b.size)) ** 2)) * side_lung
    b.opacity[i] = b.opacity[i] * (1.0 - rim)
    b.air_mult[i] += _col(b.amp["pneumothorax"][i]) * rim
    b.direct[i] += np.float32(0.10) * pleural_line


#: Painting order (pneumothorax last, as it clears the opacity in its rim).
_PAINTERS: tuple[tuple[str, Callable[[_Block, np.ndarray], None]], ...] = (
    ("atelectasis", _paint_atelectasis),
    ("effusion", _paint_effusion),
    ("infiltration", _paint_infiltration),
    ("mass", _paint_mass),
    ("nodule", _paint_nodule),
    ("pneumonia", _paint_pneumonia),
    ("consolidation", _paint_consolidation),
    ("edema", _paint_edema),
    ("fibrosis", _paint_fibrosis),
    ("pleural", _paint_pleural),
    ("hernia", _paint_hernia),
    ("pneumothorax", _paint_pneumothorax),
)
# cardiomegaly and emphysema change the anatomy itself (_geometry / _anatomy)


def _render_block(labels: np.ndarray, size: int, seed: int, block: int) -> np.ndarray:
    """Render (m, 1, S, S) float32 images for the m <= _BLOCK label rows of block ``block``.

    Pixel value = (body and bones) - depth * lung * air_mult * (1 - clip(opacity, 0, 1)) + direct,
    then per-patient brightness/offset and Gaussian pixel noise, clipped to [0, 1].
    """
    m = labels.shape[0]
    rng = np.random.default_rng([seed, 1, block])
    # Draw the full block in a fixed order so each row's randomness is the same for any n.
    params = rng.random((_BLOCK, len(_PARAMS)), dtype=np.float32)[:m]
    coarse = rng.standard_normal((_BLOCK, len(_COARSE_FIELDS), _COARSE_GRID, _COARSE_GRID), dtype=np.float32)
    fine = rng.standard_normal((_BLOCK, len(_FINE_FIELDS), _FINE_GRID, _FINE_GRID), dtype=np.float32)
    noise = rng.standard_normal((_BLOCK, size, size), dtype=np.float32)[:m]

    b = _geometry(params, labels, coarse[:m], fine[:m], size)
    _pose(b)
    img = _anatomy(b)
    for finding, paint in _PAINTERS:
        rows = np.flatnonzero(labels[:, CHEST_FINDINGS.index(finding)] > 0.5)
        if rows.size:
            paint(b, rows)

    f32 = np.float32
    air_depth = _col(0.40 * (1.0 + 0.10 * (b["air"] - 0.5)))
    img = (
        img
        - air_depth * (b.lung[-1] + b.lung[1]) * b.air_mult * (1.0 - np.clip(b.opacity, 0.0, 1.0))
        + b.direct
    )
    img = img * _col(0.92 + 0.16 * b["bright"]) + _col(0.06 * (b["offset"] - 0.5))
    img = img + f32(_PIXEL_NOISE) * noise
    return np.clip(img, 0.0, 1.0).astype(np.float32)[:, None]


def render_synthcxr(labels: np.ndarray, size: int = SYNTHCXR_DEFAULT_SIZE, seed: int = 0) -> np.ndarray:
    """Render images (N, 1, size, size) float32 in [0, 1] for given (N, 14) labels.

    Row i's patient (anatomy, pose, noise) depends only on (seed, i, size), so rendering the same
    patients with a finding switched on or off isolates that finding's pattern.
    """
    labels = np.asarray(labels, dtype=np.float32)
    if labels.ndim != 2 or labels.shape[1] != len(CHEST_FINDINGS):
        raise ValueError(f"SynthCXR: labels must have shape (N, {len(CHEST_FINDINGS)}), got {labels.shape}")
    n = labels.shape[0]
    _validate(n, size, seed)
    out = np.empty((n, 1, size, size), dtype=np.float32)
    for b in range(-(-n // _BLOCK)):
        rows = slice(b * _BLOCK, min((b + 1) * _BLOCK, n))
        out[rows] = _render_block(labels[rows], size, seed, b)
    return out


def generate_synthcxr(n: int, size: int = SYNTHCXR_DEFAULT_SIZE, seed: int = 0) -> LabeledImages:
    """n SynthCXR images (n, 1, size, size) with multi-label (n, 14) targets over CHEST_FINDINGS."""
    _validate(n, size, seed)
    labels = sample_synthcxr_labels(n, seed)
    return LabeledImages(
        images=render_synthcxr(labels, size, seed),
        labels=labels,
        class_names=CHEST_FINDINGS,
        task="multilabel",
        meta={"dataset": "synthcxr", "size": int(size), "seed": int(seed)},
    )


# ---------------------------------------------------------------------------------------------- cache


def default_cache_dir() -> Path:
    """``$FEDWEIGH_CACHE`` if set, else ``~/.cache/fedweigh``."""
    env = os.environ.get("FEDWEIGH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedweigh"


def synthcxr_cache_path(n: int, size: int, seed: int, cache_dir: str | Path | None = None) -> Path:
    """The cache file for (n, size, seed) under the current ``SYNTHCXR_VERSION``."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / f"synthcxr-v{SYNTHCXR_VERSION}-n{n}-size{size}-seed{seed}.npz"


def _read_cache(path: Path, n: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        images, labels, version = z["images"], z["labels"], int(z["version"])
    if version != SYNTHCXR_VERSION:
        raise ValueError(f"generator version {version}, expected {SYNTHCXR_VERSION}")
    if images.shape != (n, 1, size, size) or images.dtype != np.float32:
        raise ValueError(f"images are {images.dtype}{images.shape}, expected float32{(n, 1, size, size)}")
    if labels.shape != (n, len(CHEST_FINDINGS)) or labels.dtype != np.float32:
        raise ValueError(
            f"labels are {labels.dtype}{labels.shape}, expected float32{(n, len(CHEST_FINDINGS))}"
        )
    return images, labels


def _write_cache(path: Path, images: np.ndarray, labels: np.ndarray) -> None:
    """Write atomically (:func:`fedweigh.io.atomic_write_npz`: safe when processes race)."""
    atomic_write_npz(path, images=images, labels=labels, version=np.int64(SYNTHCXR_VERSION))


def load_synthcxr(
    n: int, size: int = SYNTHCXR_DEFAULT_SIZE, seed: int = 0, cache_dir: str | Path | None = None
) -> LabeledImages:
    """``generate_synthcxr(n, size, seed)``, cached as an uncompressed .npz in ``cache_dir``.

    A cache file that cannot be read or does not match (n, size, seed, version) is regenerated with a
    warning; a cache folder that cannot be written only warns.
    """
    _validate(n, size, seed)
    path = synthcxr_cache_path(n, size, seed, cache_dir)
    if path.exists():
        try:
            images, labels = _read_cache(path, n, size)
            return LabeledImages(
                images=images,
                labels=labels,
                class_names=CHEST_FINDINGS,
                task="multilabel",
                meta={"dataset": "synthcxr", "size": int(size), "seed": int(seed)},
            )
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
            warnings.warn(f"SynthCXR cache file {path} is unreadable ({err}); regenerating it", stacklevel=2)
    data = generate_synthcxr(n, size, seed)
    try:
        _write_cache(path, data.images, data.labels)
    except OSError as err:
        warnings.warn(
            f"SynthCXR: could not write cache file {path} ({err}); using in-memory data", stacklevel=2
        )
    return data


# ---------------------------------------------------------------------------------------------- figure


def save_sample_grid(
    images: np.ndarray,
    labels: np.ndarray,
    path: str | Path,
    class_names: tuple[str, ...] = CHEST_FINDINGS,
    ncols: int = 8,
    max_images: int = 32,
    dpi: int = 100,
) -> Path:
    """Save a grid of the first ``max_images`` images titled by their positive findings (PNG by suffix)."""
    from matplotlib.figure import Figure  # local import: plotting is optional at run time

    images = np.asarray(images)
    labels = np.asarray(labels)
    if images.ndim == 4:
        images = images[:, 0]
    if images.ndim != 3 or labels.shape[0] != images.shape[0]:
        raise ValueError(f"save_sample_grid: images {images.shape} and labels {labels.shape} do not match")
    count = min(max_images, images.shape[0])
    if count == 0:
        raise ValueError("save_sample_grid: no images to draw")
    ncols = min(ncols, count)
    nrows = -(-count // ncols)
    fig = Figure(figsize=(1.5 * ncols, 1.75 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for i, ax in enumerate(axes.ravel()):
        ax.axis("off")
        if i >= count:
            continue
        ax.imshow(images[i], cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
        names = [
            _ABBREVIATIONS.get(c, c[:4]) for c, on in zip(class_names, labels[i], strict=False) if on > 0.5
        ]
        title = "\n".join(["+".join(names[j : j + 2]) for j in range(0, len(names), 2)]) or "normal"
        ax.set_title(title, fontsize=7)
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=1.0 - 0.3 / nrows, wspace=0.05, hspace=0.45)
    return write_figure(path, fig, dpi=dpi)
