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
import tempfile
import warnings
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from statistics import NormalDist

import numpy as np

from fedweigh.data.base import CHEST_FINDINGS, LabeledImages

SYNTHCXR_DEFAULT_SIZE = 32
#: Bumped whenever the rendered pixels or sampled labels change; part of the cache file name.
SYNTHCXR_VERSION = 1
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
# Smooth Gaussian random fields: (name, control-grid size). Upsampled to the image by RBF interpolation.
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
    "cardiomegaly": (0.45, 0.40),
    "effusion": (0.85, 0.35),
    "infiltration": (0.80, 0.55),
    "mass": (0.90, 0.40),
    "nodule": (0.32, 0.60),
    "pneumonia": (0.90, 0.60),
    "pneumothorax": (0.30, 0.30),
    "consolidation": (0.85, 0.35),
    "edema": (0.60, 0.35),
    "emphysema": (1.00, 0.30),
    "fibrosis": (0.75, 0.60),
    "pleural": (0.90, 0.35),
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
class _Patients:
    """One block of patients: uniform parameters, labels, and the image-space quantities built so far."""

    p: np.ndarray  # (B, len(_PARAMS)) uniform(0, 1)
    y: np.ndarray  # (B, 14) labels
    size: int
    eps: float

    def __getitem__(self, name: str) -> np.ndarray:
        return self.p[:, _PARAM_INDEX[name]]

    def has(self, finding: str) -> np.ndarray:
        return self.y[:, CHEST_FINDINGS.index(finding)] > 0.5

    def severity(self, finding: str) -> np.ndarray:
        """min + (1 - min) U, (B,) float32 (see ``_SEVERITY``); only meaningful for positives."""
        low = _SEVERITY[finding][1]
        return (low + (1.0 - low) * self[f"sev_{finding}"]).astype(np.float32)

    def side(self, name: str) -> np.ndarray:
        """-1 (image left, patient's right) or +1 (image right) from a uniform column."""
        return np.where(self[name] < 0.5, -1.0, 1.0).astype(np.float32)


def _render_block(labels: np.ndarray, size: int, seed: int, block: int) -> np.ndarray:
    """Render (m, 1, S, S) float32 images for m <= _BLOCK rows of labels of block ``block``."""
    m = labels.shape[0]
    rng = np.random.default_rng([seed, 1, block])
    # Draw the full block in a fixed order so each row's randomness is the same for any n.
    params = rng.random((_BLOCK, len(_PARAMS)), dtype=np.float32)[:m]
    coarse = rng.standard_normal((_BLOCK, len(_COARSE_FIELDS), _COARSE_GRID, _COARSE_GRID), dtype=np.float32)
    fine = rng.standard_normal((_BLOCK, len(_FINE_FIELDS), _FINE_GRID, _FINE_GRID), dtype=np.float32)
    noise = rng.standard_normal((_BLOCK, size, size), dtype=np.float32)[:m]
    coarse, fine = coarse[:m], fine[:m]
    pt = _Patients(p=params, y=labels, size=size, eps=0.8 / size)
    eps = pt.eps
    f32 = np.float32

    # --- per-patient geometry, with the finding-driven changes (volume loss, enlargement) ----------------
    has = {f: pt.has(f).astype(np.float32) for f in CHEST_FINDINGS}
    sev = {f: pt.severity(f) * has[f] for f in CHEST_FINDINGS}  # 0 for negatives
    amp = {f: _SEVERITY[f][0] * sev[f] for f in CHEST_FINDINGS}
    emph = amp["emphysema"]
    atel_side = pt.side("atel_side")
    lung_a = 0.30 * (1.0 + 0.12 * (pt["lung_a"] - 0.5))
    lung_b = 0.62 * (1.0 + 0.10 * (pt["lung_b"] - 0.5))
    lung_a = lung_a * (1.0 + 0.10 * emph) * (1.0 - 0.06 * has["fibrosis"])
    lung_b = lung_b * (1.0 + 0.12 * emph) * (1.0 - 0.07 * has["fibrosis"])
    lung_cx = 0.40 + 0.04 * (pt["lung_dx"] - 0.5)
    lung_cy = -0.06 + 0.06 * (pt["lung_dy"] - 0.5) + 0.04 * emph
    dome = 0.42 + 0.06 * (pt["dome"] - 0.5) + 0.12 * emph
    dome_c = (1.0 + 0.2 * (pt["dome_c"] - 0.5)) * (1.0 - 0.7 * emph)
    # Patient's right dome (image left) sits higher than the left; atelectasis elevates its side.
    dome_side = {
        -1: dome - 0.03 - 0.10 * sev["atelectasis"] * (atel_side < 0),
        1: dome + 0.03 - 0.10 * sev["atelectasis"] * (atel_side > 0),
    }
    heart_cx = 0.08 + 0.04 * (pt["heart_x"] - 0.5) + 0.04 * sev["atelectasis"] * atel_side
    heart_cx = heart_cx + 0.06 * sev["cardiomegaly"]
    heart_cy = 0.30 + 0.04 * (pt["heart_y"] - 0.5)
    heart_a = 0.26 * (1.0 + 0.14 * (pt["heart_a"] - 0.5)) * (1.0 + amp["cardiomegaly"]) * (1.0 - 0.15 * emph)
    heart_b = 0.20 * (1.0 + 0.10 * (pt["heart_b"] - 0.5)) * (1.0 + 0.15 * sev["cardiomegaly"])

    # --- per-patient pose: u, v are patient coordinates of every pixel -----------------------------------
    gx, gy = _grid(size)
    scale = _col(0.95 + 0.10 * pt["scale"])
    rot = 0.10 * (pt["rot"] - 0.5)
    cos, sin = _col(np.cos(rot)), _col(np.sin(rot))
    xs = gx - _col(0.10 * (pt["shift_x"] - 0.5))
    ys = gy - _col(0.10 * (pt["shift_y"] - 0.5))
    u = ((cos * xs + sin * ys) / scale).astype(f32)
    v = ((cos * ys - sin * xs) / scale).astype(f32)

    # --- anatomy -------------------------------------------------------------------------------------------
    body = _ellipse(u, v, f32(0.0), f32(0.15), f32(0.95), f32(1.15), eps)
    tissue = _col(0.58 + 0.06 * (pt["tissue"] - 0.5)) + f32(0.05) * v
    img = f32(0.06) + (tissue - f32(0.06)) * body

    heart = _ellipse(u, v, _col(heart_cx), _col(heart_cy), _col(heart_a), _col(heart_b), eps)
    knob = _ellipse(u, v, f32(0.12), f32(-0.22), f32(0.08), f32(0.08), eps)
    not_mediastinum = (1.0 - heart) * (1.0 - knob)
    img = img + f32(0.04) * heart

    lung_full = {}
    for s in (-1, 1):
        cx = _col(s * lung_cx)
        below_dome = _sig((_col(dome_side[s]) + _col(dome_c) * (u - cx) ** 2 - v) / eps)
        lung_full[s] = _ellipse(u, v, cx, _col(lung_cy), _col(lung_a), _col(lung_b), eps) * below_dome
    lung = {s: lung_full[s] * not_mediastinum for s in (-1, 1)}
    both = lung[-1] + lung[1]

    # bones: spine with vertebrae, clavicles, ribs over the lungs
    spine = _sig((0.085 - np.abs(u)) / eps) * (
        f32(0.8) + f32(0.2) * np.cos(2 * np.pi * v / f32(0.17) + _col(2 * np.pi * pt["spine_phase"]))
    )
    clavicle = np.exp(-(((v + 0.70 - 0.12 * np.abs(u)) / 0.04) ** 2)) * _sig((0.75 - np.abs(u)) / eps)
    period = _col(0.23 + 0.02 * pt["rib_period"])
    rib_t = v - f32(0.25) * np.abs(u) + f32(0.35) * u**2
    ribs = (f32(0.5) + f32(0.5) * np.cos(2 * np.pi * rib_t / period + _col(2 * np.pi * pt["rib_phase"]))) ** 2
    img = img + (
        f32(0.08) * spine + f32(0.08) * clavicle * body + f32(0.06) * ribs * (lung_full[-1] + lung_full[1])
    )

    # lung opacity O (fraction of air replaced) and air multiplier; markings densest near the hila
    markings = np.maximum(_field(coarse[:, 0], size), 0.0)
    hilar = np.exp(-((np.abs(u) - 0.22) ** 2 + (v - 0.02) ** 2) / f32(0.18))
    opacity = markings * (f32(0.06) + f32(0.14) * hilar) * (1.0 - 0.6 * _col(emph))
    air_mult = np.ones_like(u) * (1.0 + 0.25 * _col(emph))
    direct = np.zeros_like(u)

    def lung_of(side: np.ndarray, idx: np.ndarray) -> np.ndarray:
        return _pick(side, lung[-1][idx], lung[1][idx])

    # --- findings ------------------------------------------------------------------------------------------
    idx = np.flatnonzero(has["atelectasis"])
    if idx.size:
        s = atel_side[idx]
        uu, vv = u[idx], v[idx]
        y0 = _col(0.05 + 0.20 * pt["atel_y"][idx])
        ang = _col(0.7 * (pt["atel_angle"][idx] - 0.5))
        width = _col(0.035 + 0.02 * pt["atel_width"][idx])
        dist = (vv - y0) * np.cos(ang) - (uu - _col(s * lung_cx[idx])) * np.sin(ang)
        band = _sig((width - np.abs(dist)) / eps)
        opacity[idx] += _col(amp["atelectasis"][idx]) * band * lung_of(s, idx)

    idx = np.flatnonzero(has["effusion"])
    if idx.size:
        s = pt.side("eff_side")[idx]
        bilateral = pt["eff_bilat"][idx] < 0.4
        uu, vv = u[idx], v[idx]
        h = _col(0.14 + 0.18 * pt["eff_height"][idx])
        for side in (-1, 1):
            on = _col((s == side) | bilateral)
            lateral = np.clip(
                (side * (uu - _col(side * lung_cx[idx])) / _col(lung_a[idx]) + 1.0) / 2.0, 0.0, 1.0
            )
            level = _col(dome_side[side][idx]) + f32(0.04) - h * (f32(0.3) + f32(0.7) * lateral**1.5)
            fluid = _sig((vv - level) / (2 * eps))
            opacity[idx] += _col(amp["effusion"][idx]) * on * fluid * lung[side][idx]

    idx = np.flatnonzero(has["infiltration"])
    if idx.size:
        uu, vv = u[idx], v[idx]
        s = pt.side("inf_side")[idx]
        bilateral = pt["inf_bilat"][idx] < 0.6
        zone = _col(np.choose(np.minimum((pt["inf_zone"][idx] * 3).astype(int), 2), [-0.30, 0.02, 0.28]))
        weight = np.exp(-(((vv - zone) / 0.25) ** 2))
        patches = _sig((_field(coarse[idx, 1], size) - _col(0.2 + 0.5 * pt["inf_thr"][idx])) / 0.25)
        on = np.where(_col(bilateral), lung[-1][idx] + lung[1][idx], lung_of(s, idx))
        opacity[idx] += _col(amp["infiltration"][idx]) * patches * weight * on

    idx = np.flatnonzero(has["mass"])
    if idx.size:
        uu, vv = u[idx], v[idx]
        s = pt.side("mass_side")[idx]
        cx = _col(s * lung_cx[idx] + 0.5 * lung_a[idx] * (2 * pt["mass_x"][idx] - 1))
        cy = _col(lung_cy[idx] + 0.45 * lung_b[idx] * (2 * pt["mass_y"][idx] - 1))
        r = _col(0.10 + 0.06 * pt["mass_r"][idx])
        angle = np.arctan2(vv - cy, uu - cx)
        r_eff = r * (1.0 + 0.12 * np.cos(3 * angle + _col(2 * np.pi * pt["mass_lobe"][idx])))
        d = np.sqrt((uu - cx) ** 2 + (vv - cy) ** 2)
        opacity[idx] += _col(amp["mass"][idx]) * _sig((r_eff - d) / eps)

    idx = np.flatnonzero(has["nodule"])
    if idx.size:
        uu, vv = u[idx], v[idx]
        sigma = f32(0.05)
        for k, present in ((1, np.ones(idx.size, bool)), (2, pt["nod_count"][idx] < 0.35)):
            s = pt.side(f"nod_side{k}")[idx]
            cx = _col(s * lung_cx[idx] + 0.55 * lung_a[idx] * (2 * pt[f"nod_x{k}"][idx] - 1))
            cy = _col(lung_cy[idx] + 0.50 * lung_b[idx] * (2 * pt[f"nod_y{k}"][idx] - 1))
            blob = np.exp(-((uu - cx) ** 2 + (vv - cy) ** 2) / (2 * sigma**2))
            direct[idx] += _col(amp["nodule"][idx]) * _col(present) * blob

    idx = np.flatnonzero(has["pneumonia"])
    if idx.size:
        uu, vv = u[idx], v[idx]
        s = pt.side("pna_side")[idx]
        cx = _col(s * (lung_cx[idx] + 0.04 + 0.06 * (pt["pna_x"][idx] - 0.5)))
        cy = _col(0.20 + 0.08 * pt["pna_y"][idx])
        region = _ellipse(uu, vv, cx, cy, f32(0.21), f32(0.17), 3 * eps)
        patchy = f32(0.7) + f32(0.3) * _sig(_field(coarse[idx, 2], size) / 0.5)
        ang = _col(np.pi * pt["pna_angle"][idx])
        stripes = (
            f32(0.5) + f32(0.5) * np.cos(2 * np.pi * (uu * np.cos(ang) + vv * np.sin(ang)) / 0.16)
        ) ** 4
        opacity[idx] += (
            _col(amp["pneumonia"][idx]) * region * (patchy - f32(0.45) * stripes) * lung_of(s, idx)
        )

    idx = np.flatnonzero(has["consolidation"])
    if idx.size:
        uu, vv = u[idx], v[idx]
        s = pt.side("cons_side")[idx]
        tilt = _col(0.5 * (pt["cons_tilt"][idx] - 0.5))
        rel = uu - _col(s * lung_cx[idx])
        upper = _col(pt["cons_lobe"][idx] < 0.6)
        fissure1 = f32(0.0) + tilt * rel
        fissure2 = f32(0.30) + tilt * rel
        above1 = _sig((fissure1 - vv) / eps)
        middle = _sig((vv - fissure1) / eps) * _sig((fissure2 - vv) / eps)
        region = np.where(upper, above1, middle)
        opacity[idx] += _col(amp["consolidation"][idx]) * region * lung_of(s, idx)

    idx = np.flatnonzero(has["edema"])
    if idx.size:
        uu, vv = u[idx], v[idx]
        batwing = np.exp(-(((np.abs(uu) - 0.22) / 0.15) ** 2 + ((vv - 0.05) / 0.25) ** 2) / 2)
        opacity[idx] += _col(amp["edema"][idx]) * batwing * both[idx]

    idx = np.flatnonzero(has["fibrosis"])
    if idx.size:
        uu, vv = u[idx], v[idx]
        net = np.exp(-((_field(fine[idx, 0], size) / 0.35) ** 2))
        q = np.sqrt(
            ((np.abs(uu) - _col(lung_cx[idx])) / _col(lung_a[idx])) ** 2
            + ((vv - _col(lung_cy[idx])) / _col(lung_b[idx])) ** 2
        )
        periphery = _sig((q - 0.5) / 0.1) * (f32(0.5) + f32(0.5) * _sig(vv / 0.2))
        opacity[idx] += _col(amp["fibrosis"][idx]) * net * periphery * both[idx]

    idx = np.flatnonzero(has["pleural"])
    if idx.size:
        uu, vv = u[idx], v[idx]
        s = pt.side("pl_side")[idx]
        bilateral = pt["pl_bilat"][idx] < 0.4
        t = _col(0.08 + 0.05 * pt["pl_thick"][idx])
        for side in (-1, 1):
            on = _col((s == side) | bilateral)
            cx = _col(side * lung_cx[idx]) - side * t / 2
            inner = _ellipse(uu, vv, cx, _col(lung_cy[idx]) + t / 2, _col(lung_a[idx]) - t / 2,
                             _col(lung_b[idx]) - t / 2, eps)  # fmt: skip
            opacity[idx] += _col(amp["pleural"][idx]) * on * lung[side][idx] * (1.0 - inner)

    idx = np.flatnonzero(has["hernia"])
    if idx.size:
        uu, vv = u[idx], v[idx]
        r = _col(0.14 + 0.05 * pt["hernia_r"][idx])
        cx = _col(0.02 + 0.08 * (pt["hernia_x"][idx] - 0.5))
        cy = _col(dome[idx]) - r * 0.6
        disk = _ellipse(uu, vv, cx, cy, r, r, eps)
        level = cy - r * _col(0.1 + 0.3 * pt["hernia_level"][idx])
        gas = _sig((level - vv) / eps)
        direct[idx] += _col(amp["hernia"][idx]) * disk * (f32(0.4) - f32(1.3) * gas)

    # pneumothorax last: the rim beyond the collapsed lung has no markings and no opacity
    idx = np.flatnonzero(has["pneumothorax"])
    if idx.size:
        uu, vv = u[idx], v[idx]
        s = pt.side("ptx_side")[idx]
        frac = 0.12 + 0.30 * sev["pneumothorax"][idx]
        a, b = lung_a[idx], lung_b[idx]
        a_c, b_c = _col(a * (1 - frac)), _col(b * (1 - 0.6 * frac))
        cx = _col(s * (lung_cx[idx] - a * frac))
        cy = _col(lung_cy[idx] + 0.6 * b * frac)
        collapsed = _ellipse(uu, vv, cx, cy, a_c, b_c, eps)
        side_lung = lung_of(s, idx)
        rim = side_lung * (1.0 - collapsed)
        q = np.sqrt(((uu - cx) / a_c) ** 2 + ((vv - cy) / b_c) ** 2)
        pleural_line = np.exp(-((((q - 1.0) * np.minimum(a_c, b_c)) / (1.2 / size)) ** 2)) * side_lung
        opacity[idx] = opacity[idx] * (1.0 - rim) + f32(0.12) * collapsed * side_lung
        air_mult[idx] += _col(amp["pneumothorax"][idx]) * rim
        direct[idx] += f32(0.10) * pleural_line

    # --- compose -------------------------------------------------------------------------------------------
    air_depth = _col(0.40 * (1.0 + 0.10 * (pt["air"] - 0.5)))
    img = img - air_depth * both * air_mult * (1.0 - np.clip(opacity, 0.0, 1.0)) + direct
    img = img * _col(0.92 + 0.16 * pt["bright"]) + _col(0.06 * (pt["offset"] - 0.5))
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
    """Write atomically: a temporary file in the same folder, then os.replace (safe when processes race)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, images=images, labels=labels, version=np.int64(SYNTHCXR_VERSION))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path
