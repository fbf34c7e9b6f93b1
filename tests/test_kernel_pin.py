"""Pinned CPU kernels: every bench and simulator process gets them; a short cell is bit-identical
to the committed fingerprint (docs/results/engine/fingerprint.json)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedweigh import cli
from fedweigh.kernels import KERNEL_SWITCH, PINNED_KERNELS, pinned_env

ROOT = Path(__file__).resolve().parents[1]
FINGERPRINT = ROOT / "docs" / "results" / "engine" / "fingerprint.json"
MEASURED = ROOT / "docs" / "results" / "engine" / "kernel-pin.json"


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


def test_a_short_cell_is_bit_identical_to_the_committed_fingerprint():
    expected = json.loads(FINGERPRINT.read_text())
    import torch

    assert torch.__version__ == expected["torch"], (
        f"the fingerprint was made with torch {expected['torch']}, this is {torch.__version__}: "
        "rerun benchmarks/bench_kernel_pin.py --fingerprint to make one for this build"
    )
    env = {k: v for k, v in os.environ.items() if k not in PINNED_KERNELS and k != KERNEL_SWITCH}
    env["PYTHONPATH"] = str(ROOT / "custom")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_kernel_pin.py"), "--cell"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["kernels"]["cpu_capability"] == "AVX2"  # the pin took effect in the fresh process
    assert got["rows"] == expected["rows"]  # every round's losses and AUCs, to the last bit
    assert got["final_test_auc"] == expected["final_test_auc"] and got["scores_sum"] == expected["scores_sum"]


def test_the_measured_effect_of_the_pin_is_committed():
    measured = json.loads(MEASURED.read_text())
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
