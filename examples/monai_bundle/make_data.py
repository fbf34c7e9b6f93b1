"""Write small made-up image sets for the example's sites: PNG files and a MONAI data list per site.

    python make_data.py --out data --sites 3

Site k gets ``k * scale`` training images (and a quarter as many for validation); class c is a bright
square in quadrant c of a noisy 16 x 16 image, and each site over-represents one class, so the sites
differ in size and in class mix, which is where the weighting schemes differ.
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

NUM_CLASSES = 4
SIZE = 16


def _image(label: int, rng: np.random.Generator) -> np.ndarray:
    image = 0.3 * rng.standard_normal((SIZE, SIZE)) + 0.2
    r, c = divmod(label, 2)
    half = SIZE // 2
    image[r * half : (r + 1) * half, c * half : (c + 1) * half] += 1.0
    return (np.clip(image / 1.6, 0.0, 1.0) * 255).astype(np.uint8)


def write_site_data(root: str | Path, site_name: str, num_train: int, num_val: int) -> Path:
    """Write ``root/site_name/`` (PNG images + ``datalist.json``) and return that folder."""
    folder = Path(root) / site_name
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(zlib.crc32(site_name.encode()))
    index = int("".join(ch for ch in site_name if ch.isdigit()) or 1)
    mix = np.ones(NUM_CLASSES)
    mix[index % NUM_CLASSES] = 4.0
    datalist: dict[str, list] = {"training": [], "validation": []}
    for part, count in (("training", num_train), ("validation", num_val)):
        for i, label in enumerate(rng.choice(NUM_CLASSES, size=count, p=mix / mix.sum())):
            name = f"images/{part}_{i:04d}.png"
            Image.fromarray(_image(int(label), rng)).save(folder / name)
            # relative to the site's folder (the bundle's dataset_dir): the list stays valid wherever
            # the folder is, and whatever folder the site runs in
            datalist[part].append({"image": name, "label": int(label)})
    (folder / "datalist.json").write_text(json.dumps(datalist, indent=1))
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="data")
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--scale", type=int, default=32)
    args = parser.parse_args()
    for k in range(1, args.sites + 1):
        print(write_site_data(args.out, f"site-{k}", k * args.scale, max(4, k * args.scale // 4)))
