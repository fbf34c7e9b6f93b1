"""What pinning the CPU kernels changes: the arithmetic of a short cell, and its speed.

Runs the same short bench cell (SynthCXR, ``iid-4`` restricted to two sites, FedAvg, the smoke
profile's compact DenseNet, 2 rounds, one thread) in fresh processes, alternately pinned
(:mod:`fedweigh.kernels`: AVX2 for ATen and oneDNN) and native (``FEDWEIGH_CPU_KERNELS=native``: the
machine's widest kernels), and reports whether the per-round losses and AUCs are bit-identical
between the two, their largest difference, and the ratio of the cells' median times
(pinned / native). ``--fingerprint PATH`` records the pinned cell's per-round figures for this
machine's processor (:func:`fedweigh.kernels.cpu_identity`) in that file, next to those of the other
processors recorded there; tests/test_kernel_pin.py compares a fresh run with its processor's entry
bit for bit, and with every other entry within a stated tolerance.

    .venv/bin/python benchmarks/bench_kernel_pin.py [--repeats 2] \
        [--json docs/results/engine/kernel-pin.json] [--fingerprint docs/results/engine/fingerprint.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: The fingerprint cell: tiny settings, a few seconds of training.
CELL = {"scenario": "iid-4", "method": "fedavg", "seed": 0, "sites": ["site-1", "site-2"], "rounds": 2}


def run_cell_here() -> dict:
    """The fingerprint cell in this process: per-round figures (exact, as float.hex), the time it
    took to train, and the kernel state it ran with."""
    from fedweigh.kernels import cpu_identity, kernel_state, pin_cpu_kernels

    pin_cpu_kernels(threads=1)
    import torch

    torch.set_num_threads(1)
    from fedweigh.bench.config import make_config
    from fedweigh.bench.modes import run_cell

    config = make_config(
        "smoke",
        "synthcxr",
        methods=[CELL["method"]],
        scenarios=[CELL["scenario"]],
        sites=CELL["sites"],
        rounds=CELL["rounds"],
    )
    t0 = time.perf_counter()
    record, scores, _ = run_cell(config, CELL["scenario"], CELL["method"], CELL["seed"])
    seconds = time.perf_counter() - t0
    keys = ("train_loss", "val_auc", "test_auc", "test_loss")
    rows = [{k: float(r[k]).hex() for k in keys if k in r} | {"round": r["round"]} for r in record["rows"]]
    return {
        "cell": CELL,
        "rows": rows,
        "final_test_auc": float(record["rows"][-1]["test_auc"]).hex(),
        "scores_sum": float(scores.astype("float64").sum()).hex(),
        "seconds": seconds,
        "kernels": kernel_state(),
        "machine": cpu_identity(),
    }


def record_fingerprint(path: Path, cell: dict, made: str) -> dict:
    """Put ``cell``'s figures into the fingerprint file at ``path`` as its processor's entry
    (replacing an earlier entry of the same processor, keeping the others); returns the file's data."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    if data and (data.get("cell") != CELL or data.get("torch") != cell["kernels"]["torch"]):
        data = {}  # another cell or torch build: the old entries no longer apply
    entries = [e for e in data.get("fingerprints", []) if e.get("machine") != cell["machine"]]
    entry = {"machine": cell["machine"], "made": made}
    entry |= {k: cell[k] for k in ("rows", "final_test_auc", "scores_sum")}
    data = {"cell": CELL, "torch": cell["kernels"]["torch"], "fingerprints": [*entries, entry]}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


def _child(native: bool) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
    }
    env["FEDWEIGH_CPU_KERNELS"] = "native" if native else "avx2"
    out = subprocess.run(
        [sys.executable, __file__, "--cell"], env=env, capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _largest_difference(a: dict, b: dict) -> float:
    diffs = [
        abs(float.fromhex(ra[k]) - float.fromhex(rb[k]))
        for ra, rb in zip(a["rows"], b["rows"], strict=True)
        for k in ra
        if k != "round" and k in rb
    ]
    return max(diffs) if diffs else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", action="store_true", help="run the cell in this process, print JSON")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--fingerprint", type=Path)
    args = ap.parse_args(argv)
    if args.cell:
        print(json.dumps(run_cell_here()))
        return 0
    pinned, native = [], []
    for _ in range(args.repeats):  # alternating, so a change in the machine's load falls on both
        pinned.append(_child(native=False))
        native.append(_child(native=True))
    same_pinned = all(p["rows"] == pinned[0]["rows"] for p in pinned)
    result = {
        "command": "python benchmarks/bench_kernel_pin.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "cell": CELL,
        "machine": pinned[0]["machine"],
        "pinned_kernels": pinned[0]["kernels"],
        "native_kernels": native[0]["kernels"],
        "pinned_repeats_identical": same_pinned,
        "pinned_equals_native_bitwise": pinned[0]["rows"] == native[0]["rows"],
        "largest_difference_pinned_vs_native": _largest_difference(pinned[0], native[0]),
        "final_test_auc": {
            "pinned": float.fromhex(pinned[0]["final_test_auc"]),
            "native": float.fromhex(native[0]["final_test_auc"]),
        },
        "train_loss_by_round": {
            "pinned": [float.fromhex(r["train_loss"]) for r in pinned[0]["rows"] if "train_loss" in r],
            "native": [float.fromhex(r["train_loss"]) for r in native[0]["rows"] if "train_loss" in r],
        },
        "seconds": {"pinned": [p["seconds"] for p in pinned], "native": [n["seconds"] for n in native]},
        "time_ratio_pinned_over_native": statistics.median(p["seconds"] for p in pinned)
        / statistics.median(n["seconds"] for n in native),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.fingerprint:
        import datetime as dt

        record_fingerprint(args.fingerprint, pinned[0], dt.date.today().isoformat())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
