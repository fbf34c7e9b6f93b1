"""Pinned CPU kernels: every bench and simulator process gets them; a short cell is bit-identical
between two fresh processes, to the committed fingerprint of this machine's processor, and within a
stated tolerance of every other processor's (docs/results/engine/fingerprint.json)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from fedweigh import cli
from fedweigh.kernels import KERNEL_SWITCH, PINNED_KERNELS, cpu_identity, pinned_env

ROOT = Path(__file__).resolve().parents[1]
FINGERPRINT = ROOT / "docs" / "results" / "engine" / "fingerprint.json"
MEASURED = sorted((ROOT / "docs" / "results" / "engine").glob("kernel-pin*.json"))
#: How far another processor's pinned cell may lie from a recorded one: relative, on the losses, and
#: absolute, on the test AUC. Measured between three processors: up to 6.8e-4 and 0.022; between a pinned and
#: an unpinned cell on one processor: 1.5e-3 and 0.024 (docs/bench.md). The losses tell a cell run without
#: the pin apart; the test AUC of this small cell only a grossly different one.
LOSS_RELATIVE, TEST_AUC_ABSOLUTE = 1e-3, 0.05


def test_pinned_env_adds_the_pins_keeps_the_users_values_and_native_turns_them_off():
    env = pinned_env({"PATH": "/bin"}, threads=2)
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert env["DNNL_MAX_CPU_ISA"] == "AVX2" and env["OMP_NUM_THREADS"] == "2" and env["PATH"] == "/bin"
    assert pinned_env({"ATEN_CPU_CAPABILITY": "default"})["ATEN_CPU_CAPABILITY"] == "default"
    assert not set(PINNED_KERNELS) & set(pinned_env({KERNEL_SWITCH: "native"}))
    with pytest.raises(ValueError, match="threads"):
        pinned_env({}, threads=0)


def test_the_simulator_fedweigh_launches_runs_pinned(monkeypatch, tmp_path):
    seen = {}

    def call(cmd, env=None, **_):
        seen["env"] = env
        return 0

    monkeypatch.setattr(cli.subprocess, "call", call)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv(KERNEL_SWITCH, raising=False)
    assert cli.run_simulator(tmp_path / "job", tmp_path / "ws", 2) == 0
    assert {k: seen["env"][k] for k in PINNED_KERNELS} == PINNED_KERNELS


def test_the_bench_runner_pins_the_environment_its_workers_inherit(monkeypatch, tmp_path):
    from fedweigh.bench import runner

    for key in PINNED_KERNELS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv(KERNEL_SWITCH, raising=False)

    class Stop(Exception):
        pass

    def stop(*_, **__):
        raise Stop

    monkeypatch.setattr(runner, "run_cells", stop)
    from fedweigh.bench.config import make_config

    config = make_config("smoke", "synthcxr", methods=["fedavg"], scenarios=["iid-4"], rounds=1)
    with pytest.raises(Stop):
        runner.run_bench(config, tmp_path, progress=False)
    assert {k: os.environ[k] for k in PINNED_KERNELS} == PINNED_KERNELS


def _pinned_cell() -> dict:
    """The fingerprint cell in a fresh process that starts with none of the pins set."""
    env = {k: v for k, v in os.environ.items() if k not in PINNED_KERNELS and k != KERNEL_SWITCH}
    env["PYTHONPATH"] = str(ROOT / "custom")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_kernel_pin.py"), "--cell"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _far_apart(got: dict, recorded: dict) -> list[str]:
    """Where ``got`` lies beyond the tolerance of ``recorded``: one line per figure."""
    far = []
    for a, b in zip(got["rows"], recorded["rows"], strict=True):
        for key in a.keys() & b.keys() - {"round"}:
            x, y = float.fromhex(a[key]), float.fromhex(b[key])
            if key.endswith("loss") and abs(x - y) > LOSS_RELATIVE * abs(y):
                far.append(f"round {a['round']} {key}: {x} against {y}")
            if key == "test_auc" and abs(x - y) > TEST_AUC_ABSOLUTE:
                far.append(f"round {a['round']} {key}: {x} against {y}")
    return far


def test_the_fingerprint_names_each_processor_once_and_holds_this_cell():
    recorded = json.loads(FINGERPRINT.read_text())
    machines = [json.dumps(e["machine"], sort_keys=True) for e in recorded["fingerprints"]]
    assert len(machines) == len(set(machines)) >= 2  # two processors measured against each other
    named = [e["machine"] for e in recorded["fingerprints"] if e["machine"] is not None]
    assert named and all(set(m) == set(cpu_identity("")) for m in named)


def test_a_short_cell_is_bit_identical_on_a_machine_and_to_its_processors_fingerprint():
    recorded = json.loads(FINGERPRINT.read_text())
    import torch

    assert torch.__version__ == recorded["torch"], (
        f"the fingerprint was made with torch {recorded['torch']}, this is {torch.__version__}: "
        "rerun benchmarks/bench_kernel_pin.py --fingerprint to make one for this build"
    )
    got, again = _pinned_cell(), _pinned_cell()
    assert got["kernels"]["cpu_capability"] == "AVX2"  # the pin took effect in the fresh process
    assert got["cell"] == recorded["cell"]
    exact = ("rows", "final_test_auc", "scores_sum")
    assert {k: got[k] for k in exact} == {k: again[k] for k in exact}  # two processes, the same bits
    for entry in recorded["fingerprints"]:  # every processor on record, within the tolerance
        assert not _far_apart(got, entry), (entry["machine"], _far_apart(got, entry))
    mine = [e for e in recorded["fingerprints"] if e["machine"] == got["machine"]]
    if not mine:
        warnings.warn(
            f"no fingerprint for this processor ({got['machine']}): compared within the tolerance "
            "only; benchmarks/bench_kernel_pin.py --fingerprint records one",
            stacklevel=1,
        )
    for entry in mine:  # this processor: every round's losses and AUCs, to the last bit
        assert {k: got[k] for k in exact} == {k: entry[k] for k in exact}


def test_the_tolerance_tells_two_processors_apart_from_a_different_cell():
    entries = json.loads(FINGERPRINT.read_text())["fingerprints"]
    assert entries[0]["rows"] != entries[1]["rows"]  # the two processors differ in the last bits
    assert not _far_apart(entries[0], entries[1]) and not _far_apart(entries[1], entries[0])
    moved = json.loads(json.dumps(entries[1]))
    moved["rows"][-1]["test_auc"] = (float.fromhex(entries[0]["rows"][-1]["test_auc"]) + 0.051).hex()
    assert _far_apart(moved, entries[0]) == [
        f"round 2 test_auc: {float.fromhex(moved['rows'][-1]['test_auc'])} "
        f"against {float.fromhex(entries[0]['rows'][-1]['test_auc'])}"
    ]
    moved = json.loads(json.dumps(entries[1]))
    moved["rows"][0]["train_loss"] = (float.fromhex(entries[0]["rows"][0]["train_loss"]) * 1.0011).hex()
    assert [line.split(":")[0] for line in _far_apart(moved, entries[0])] == ["round 0 train_loss"]


def test_cpu_identity_reads_the_first_processor_and_names_what_it_lacks():
    text = (
        "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
        "stepping\t: 8\nflags\t\t: fpu sse2 avx avx2 fma avx512f amx_tile\n\n"
        "processor\t: 1\nvendor_id\t: Other\n"
    )
    assert cpu_identity(text) == {
        "vendor": "GenuineIntel",
        "family": "6",
        "model": "143",
        "stepping": "8",
        "vector": "avx avx2 fma avx512f amx_tile",
    }
    assert cpu_identity("") == dict.fromkeys(("vendor", "family", "model", "stepping", "vector"), "unknown")


@pytest.mark.parametrize("path", MEASURED, ids=lambda p: p.name)
def test_the_measured_effect_of_the_pin_is_committed(path):
    measured = json.loads(path.read_text())
    assert measured["pinned_kernels"]["cpu_capability"] == "AVX2"
    assert measured["pinned_repeats_identical"] is True
    assert measured["pinned_equals_native_bitwise"] is (
        measured["largest_difference_pinned_vs_native"] == 0.0
    )
    assert measured["time_ratio_pinned_over_native"] > 0


def test_a_recipe_run_in_the_simulator_env_pins_its_sites(monkeypatch):
    from nvflare.recipe import SimEnv

    from fedweigh.flare.recipes import MethodRecipe

    for key in PINNED_KERNELS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv(KERNEL_SWITCH, raising=False)
    MethodRecipe(method="uniform", num_rounds=1, min_clients=2).process_env(SimEnv(num_clients=2))
    assert {k: os.environ[k] for k in PINNED_KERNELS} == PINNED_KERNELS
