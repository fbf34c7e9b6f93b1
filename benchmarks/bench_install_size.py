"""What a fedweigh install takes on disk, with torch's CPU-only build and with PyPI's default (CUDA) build.

For each ``--variant NAME=TORCH_SPEC`` a fresh virtual environment is created, torch is installed by
that spec first (with ``--index-url URL`` when the variant names one: ``NAME=SPEC@URL``), then the
package itself (no test tools), as README's "CPU-only install" does. Reported per variant: the
venv's size, the largest installed packages, the torch version, every ``nvidia-*``/``triton``
distribution (none is the point of a CPU-only install), the install's wall time, and the time of
``fedweigh --version``. With ``--demo`` the CPU variant also runs ``fedweigh demo`` and records its
wall time and last lines.

    python benchmarks/bench_install_size.py \
        --variant cpu=torch==2.13.0 --variant cuda=torch==2.14.1 \
        [--demo cpu] --out docs/results/install/install-size.json

On a machine that reaches download.pytorch.org, ``cpu='torch>=2.4@https://download.pytorch.org/whl/cpu'``
is the README's command itself. The figures depend on the torch release and the platform; the JSON
records both.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CUDA_DISTRIBUTIONS = ("nvidia-", "triton")


def dir_mib(path: Path) -> float:
    """Size of the files under ``path`` in MiB (``du``'s apparent size: links counted once)."""
    seen: set[int] = set()
    total = 0
    for p in path.rglob("*"):
        try:
            st = p.lstat()
        except OSError:
            continue
        if p.is_symlink() or not p.is_file() or st.st_ino in seen:
            continue
        seen.add(st.st_ino)
        total += st.st_size
    return total / 2**20


def pip(venv: Path, *args: str) -> None:
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)


def installed(venv: Path) -> dict[str, str]:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {d["name"].lower(): d["version"] for d in json.loads(out)}


def measure(name: str, spec: str, index_url: str | None, root: Path, demo: bool) -> dict:
    venv = root / name
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip(venv, *(["--index-url", index_url] if index_url else []), spec)
    pip(venv, str(ROOT))
    install_s = time.perf_counter() - t0
    dists = installed(venv)
    site = next((venv / "lib").glob("python*/site-packages"))
    sizes = {p.name: dir_mib(p) for p in site.iterdir() if p.is_dir() and not p.name.endswith("-info")}
    largest = dict(sorted(sizes.items(), key=lambda kv: -kv[1])[:8])
    t0 = time.perf_counter()
    version = subprocess.run(
        [str(venv / "bin" / "fedweigh"), "--version"], check=True, capture_output=True, text=True
    )
    version_s = time.perf_counter() - t0
    row = {
        "variant": name,
        "torch_spec": spec,
        "index_url": index_url,
        "torch": dists.get("torch"),
        "venv_mib": round(dir_mib(venv), 1),
        "largest_mib": {k: round(v, 1) for k, v in largest.items()},
        "cuda_distributions": sorted(d for d in dists if d.startswith(CUDA_DISTRIBUTIONS)),
        "distributions": len(dists),
        "install_s": round(install_s, 1),
        "version_output": version.stdout.strip(),
        "version_s": round(version_s, 3),
    }
    if demo:
        work = Path(tempfile.mkdtemp(prefix="demo-", dir=root))
        t0 = time.perf_counter()
        res = subprocess.run(
            [str(venv / "bin" / "fedweigh"), "demo"], cwd=work, capture_output=True, text=True, check=False
        )
        row["demo"] = {
            "returncode": res.returncode,
            "wall_s": round(time.perf_counter() - t0, 1),
            "last_lines": (res.stdout + res.stderr).strip().splitlines()[-6:],
        }
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--variant", action="append", required=True, help="NAME=TORCH_SPEC or NAME=TORCH_SPEC@INDEX_URL"
    )
    ap.add_argument("--demo", action="append", default=[], help="variants that also run `fedweigh demo`")
    ap.add_argument(
        "--workdir", type=Path, default=None, help="where the venvs go (default: a temporary folder)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the venvs")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="fedweigh-install-"))
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for v in args.variant:
            name, sep, rest = v.partition("=")
            if not sep or not name or not rest:
                ap.error(f"--variant {v!r}: expected NAME=TORCH_SPEC[@INDEX_URL]")
            spec, _, url = rest.partition("@")
            print(f"[{name}] installing torch ({spec}) then fedweigh into a fresh venv", flush=True)
            rows.append(measure(name, spec, url or None, root, name in args.demo))
            r = rows[-1]
            print(
                f"[{name}] {r['venv_mib']:.0f} MiB, torch {r['torch']}, CUDA packages: {len(r['cuda_distributions'])}"
            )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    result = {
        "command": "python benchmarks/bench_install_size.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "variants": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
