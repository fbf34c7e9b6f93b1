"""Each example runs as its README says, command by command, from its own folder (a copy of it, so
that the data and jobs it writes stay out of the checkout); /tmp paths go to the test's folder."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_commands(example: str) -> list[str]:
    """The commands of the example README's bash block, comments stripped."""
    text = (ROOT / "examples" / example / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def _run_readme(example: str, tmp_path: Path) -> list[tuple[str, subprocess.CompletedProcess]]:
    folder = tmp_path / "examples" / example
    shutil.copytree(ROOT / "examples" / example, folder, ignore=shutil.ignore_patterns("data", "__pycache__"))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "custom"), os.environ.get("PYTHONPATH", "")]),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    done = []
    cwd = tmp_path
    for command in readme_commands(example):
        if command.startswith("pip install"):
            continue  # the venv has the extras (the dev extra includes the bundle's)
        if command.startswith("cd "):
            cwd = tmp_path / command.split()[1]
            assert cwd == folder, command
            continue
        command = command.replace("/tmp/", f"{tmp_path}/")
        run = subprocess.run(
            ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
        )
        assert run.returncode == 0, f"{command}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
        done.append((command, run))
    return done


def _every_round_aggregated_every_site(workspace: Path, sites: int) -> None:
    (metrics,) = workspace.rglob("fedweigh_metrics.json")
    rounds = [r for r in json.loads(metrics.read_text())["rounds"] if r["round"] >= 1]
    assert rounds
    for r in rounds:
        assert r["global_updated"] is True and r["excluded"] == {}, r
        assert len(r["weights"]) == sites


def _byo_feddraw_weighs_by_size_first(workspace: Path) -> None:
    """examples/byo_feddraw under FedDRAW: site k has k * 64 images, so the N_k prior of round 1 weighs
    the bigger sites more; every round's weights sum to 1; the global model is saved once."""
    (metrics,) = workspace.rglob("fedweigh_metrics.json")
    rounds = [r for r in json.loads(metrics.read_text())["rounds"] if r["round"] >= 1]
    assert len(rounds) >= 2
    for r in rounds:
        assert sorted(r["weights"]) == ["site-1", "site-2", "site-3"]
        assert sum(r["weights"].values()) == pytest.approx(1.0)
    w = rounds[0]["weights"]
    assert w["site-1"] < w["site-2"] < w["site-3"]
    assert len(list(workspace.rglob("FL_global_model.pt"))) == 1


@pytest.mark.slow
@pytest.mark.parametrize("example", ["byo_feddraw", "monai_bundle"])
def test_the_example_runs_as_its_readme_says(example, tmp_path):
    done = _run_readme(example, tmp_path)
    simulated = [c for c, _ in done if c.startswith("nvflare simulator")]
    assert simulated
    for command in simulated:
        words = command.split()
        workspace = Path(words[words.index("-w") + 1])
        _every_round_aggregated_every_site(workspace, int(words[words.index("-n") + 1]))
        if example == "byo_feddraw":
            _byo_feddraw_weighs_by_size_first(workspace)
    executed = [run for c, run in done if c.startswith("python job.py") and "--out" not in c]
    assert executed  # the README's `python job.py` runs the recipe in the simulator, and says how it went
    for run in executed:
        assert "round(s) changed the global model" in run.stdout, run.stdout[-2000:]
