"""The committed job folders equal a fresh export of the recipes."""

import filecmp
from pathlib import Path

from fedweigh.flare.jobs import JOB_CATALOGUE, export_jobs

JOBS = Path(__file__).resolve().parents[1] / "jobs"


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_committed_jobs_equal_a_fresh_export(tmp_path):
    export_jobs(tmp_path, None)
    assert sorted(p.name for p in JOBS.iterdir() if p.is_dir()) == sorted(JOB_CATALOGUE)
    for name in JOB_CATALOGUE:
        fresh, committed = _tree(tmp_path / name), _tree(JOBS / name)
        assert sorted(fresh) == sorted(committed), f"{name}: files differ; run `fedweigh jobs export`"
        for rel in fresh:
            assert fresh[rel] == committed[rel], f"jobs/{name}/{rel} differs from a fresh export"


def test_export_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    export_jobs(a, ["synthcxr_fedavg"])
    export_jobs(b, ["synthcxr_fedavg"])
    cmp = filecmp.dircmp(a / "synthcxr_fedavg", b / "synthcxr_fedavg")
    assert not cmp.diff_files and not cmp.left_only and not cmp.right_only
