"""benchmarks/paper_gpu.py: the commands it runs land in the paper profile's settings on the GPU, and
a spent budget stops the bench and says how to continue."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "paper_gpu.py"


def _printed_commands(tmp_path: Path, *extra: str) -> list[list[str]]:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "paper"), "--print", *extra],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [shlex.split(line) for line in out.splitlines()]


def test_each_seeds_command_configures_the_paper_profile_on_cuda(tmp_path):
    from fedweigh.bench.cli import _bench_config
    from fedweigh.cli import build_parser

    commands = _printed_commands(tmp_path)
    assert len(commands) == 3
    for seed, cmd in enumerate(commands):
        assert cmd[1:4] == ["-m", "fedweigh.cli", "bench"]
        args = build_parser().parse_args(cmd[3:])
        config = _bench_config(args)  # where the arguments land: the bench's configuration
        assert config.profile == "paper" and config.rounds == 50 and list(config.seeds) == [seed]
        assert list(config.scenarios) == ["label-a0.5", "quantity-shift"]
        assert list(config.methods) == ["fedavg", "feddraw", "fedbb-paper", "dafl"]
        c = config.client
        assert (c.arch, c.size, c.num_images, c.device, c.batch_size) == (
            "densenet121",
            64,
            20000,
            "cuda",
            32,
        )
        assert args.jobs == 8 and Path(args.out) == tmp_path / "paper" / f"seed-{seed}"


def test_options_after_the_separator_reach_the_bench(tmp_path):
    from fedweigh.bench.cli import _bench_config
    from fedweigh.cli import build_parser

    (cmd,) = _printed_commands(tmp_path, "--seeds", "1", "--jobs", "4", "--", "--rounds", "5")
    args = build_parser().parse_args(cmd[3:])
    assert _bench_config(args).rounds == 5 and args.jobs == 4


def test_a_spent_budget_stops_the_bench_and_says_how_to_continue(tmp_path):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "p"), "--device", "cpu", "--budget-s", "0.5"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 3, run.stdout + run.stderr
    assert "rerun the same command to continue" in run.stdout
    record = json.loads((tmp_path / "p" / "paper_gpu.json").read_text())
    assert record["ended"] is False and record["budget_s"] == 0.5
    assert record["seeds"]["0"]["returncode"] is None and record["seeds"]["0"]["cells_done"] == 0
    # the bench's process group is ended at once (SIGTERM), not left to the 30 s grace before SIGKILL
    assert record["wall_s"] < 25, record


@pytest.mark.parametrize("bad", [["--budget-s", "0"], ["--jobs", "0"]])
def test_bad_budget_or_jobs_is_refused(tmp_path, bad):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), *bad], capture_output=True, text=True
    )
    assert run.returncode == 2 and "--budget-s must be > 0 and --jobs >= 1" in run.stderr
