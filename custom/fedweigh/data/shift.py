"""Per-site acquisition shift: each hospital's scanner and post-processing change how images look.

A profile is applied to images x in [0, 1] of shape (N, C, H, W) in acquisition order:

    x1 = G_sigma * x                                   detector blur (spatial axes only)
    x2 = clip(contrast * (x1 - 0.5) + 0.5 + offset)    windowing: contrast about mid-grey, brightness
    x3 = x2 ** gamma                                   display look-up table
    x4 = clip(x3 + noise_std * eps),  eps ~ N(0, 1)    quantum / electronic noise

with clip to [0, 1]. Site profiles spread over the parameter box with a Kronecker low-discrepancy
sequence (Roberts' R_d sequence, 2018), so even a handful of sites differ from one another, and every
deviation from the identity scales with ``strength`` (strength 0 is no shift at all).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Image side the ``blur_sigma`` unit refers to; sigma scales with the actual side H as sigma * H / 32.
BLUR_REFERENCE_SIZE = 32

#: Half-widths of the parameter box at strength 1 (log-contrast, log-gamma, offset) and the maxima
#: (noise_std, blur_sigma). Strength 1 spans contrast 0.70..1.42, gamma 0.70..1.42, offset +-0.06,
#: noise up to 0.03 and blur up to 0.8 px at 32 px.
_LOG_CONTRAST, _LOG_GAMMA, _OFFSET, _NOISE, _BLUR = 0.35, 0.35, 0.06, 0.03, 0.8


def _kronecker_steps(dim: int) -> np.ndarray:
    """Roberts' R_d steps 1 / phi_d ** (1..d), phi_d the real root of x ** (d + 1) = x + 1."""
    phi = 2.0
    for _ in range(64):  # fixed-point iteration converges quickly
        phi = (1.0 + phi) ** (1.0 / (dim + 1))
    return phi ** -np.arange(1, dim + 1, dtype=np.float64)


@dataclass(frozen=True)
class AcquisitionProfile:
    """One site's acquisition parameters; the defaults are the identity (see the module formula)."""

    contrast: float = 1.0
    gamma: float = 1.0
    noise_std: float = 0.0
    blur_sigma: float = 0.0  # pixels of a 32 x 32 image; scaled with resolution
    offset: float = 0.0

    def __post_init__(self) -> None:
        if self.contrast <= 0 or self.gamma <= 0:
            raise ValueError(f"contrast and gamma must be positive, got {self.contrast}, {self.gamma}")
        if self.noise_std < 0 or self.blur_sigma < 0:
            raise ValueError(
                f"noise_std and blur_sigma must be >= 0, got {self.noise_std}, {self.blur_sigma}"
            )

    @property
    def is_identity(self) -> bool:
        return (self.contrast, self.gamma, self.noise_std, self.blur_sigma, self.offset) == (1, 1, 0, 0, 0)


def site_profile(site_index: int, strength: float = 1.0, seed: int = 0) -> AcquisitionProfile:
    """Deterministic profile of site ``site_index`` (0-based): point ``site_index + 1`` of a seeded R_5
    sequence u in [0, 1)^5, mapped to contrast = exp(0.35 s v1), gamma = exp(0.35 s v2),
    offset = 0.06 s v3 (v = 2u - 1), noise_std = 0.03 s u4, blur_sigma = 0.8 s u5 with s = strength.
    """
    if site_index < 0:
        raise ValueError(f"site_index must be >= 0, got {site_index}")
    if strength < 0:
        raise ValueError(f"strength must be >= 0, got {strength}")
    start = np.random.default_rng([seed, 0x5EED]).random(5)
    u = np.mod(start + (site_index + 1) * _kronecker_steps(5), 1.0)
    v = 2.0 * u - 1.0
    s = float(strength)
    return AcquisitionProfile(
        contrast=float(np.exp(_LOG_CONTRAST * s * v[0])),
        gamma=float(np.exp(_LOG_GAMMA * s * v[1])),
        noise_std=float(_NOISE * s * u[3]),
        blur_sigma=float(_BLUR * s * u[4]),
        offset=float(_OFFSET * s * v[2]),
    )


#: A degraded acquisition at strength 1: contrast exp(-0.5) ~ 0.61, blur 1.2 px (at 32 px), noise 0.06.
_DEGRADED_LOG_CONTRAST, _DEGRADED_BLUR, _DEGRADED_NOISE = 0.5, 1.2, 0.06


def degraded_profile(strength: float = 1.0) -> AcquisitionProfile:
    """A uniformly worse scanner (old detector, poor exposure): contrast = exp(-0.5 s),
    blur_sigma = 1.2 s px (at 32 px), noise_std = 0.06 s, gamma 1, offset 0; s = strength >= 0."""
    if strength < 0:
        raise ValueError(f"strength must be >= 0, got {strength}")
    s = float(strength)
    return AcquisitionProfile(
        contrast=float(np.exp(-_DEGRADED_LOG_CONTRAST * s)),
        noise_std=_DEGRADED_NOISE * s,
        blur_sigma=_DEGRADED_BLUR * s,
    )


def apply_acquisition_shift(images: np.ndarray, profile: AcquisitionProfile, seed: int) -> np.ndarray:
    """Apply ``profile`` to float (N, C, H, W) images in [0, 1]; returns a new float32 array in [0, 1].

    ``seed`` drives the noise only; the same (images, profile, seed) always gives the same output.
    """
    if images.ndim != 4:
        raise ValueError(f"images must have shape (N, C, H, W), got {images.shape}")
    out = np.array(images, dtype=np.float32, copy=True)
    if profile.is_identity or out.size == 0:
        return out
    if profile.blur_sigma > 0:
        from scipy.ndimage import gaussian_filter

        sigma = profile.blur_sigma * out.shape[-1] / BLUR_REFERENCE_SIZE
        out = gaussian_filter(out, sigma=(0.0, 0.0, sigma, sigma), mode="reflect")
    if profile.contrast != 1 or profile.offset != 0:
        out -= np.float32(0.5)
        out *= np.float32(profile.contrast)
        out += np.float32(0.5 + profile.offset)
    np.clip(out, 0.0, 1.0, out=out)
    if profile.gamma != 1:
        np.power(out, np.float32(profile.gamma), out=out)
    if profile.noise_std > 0:
        noise = np.random.default_rng(seed).standard_normal(out.shape, dtype=np.float32)
        out += np.float32(profile.noise_std) * noise
        np.clip(out, 0.0, 1.0, out=out)
    return out
