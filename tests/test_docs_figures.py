"""Figures quoted in the docs come from the data committed beside them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _assert_quoted(doc: str, expected: list[str], what: str) -> None:
    """Every line of ``expected`` appears in ``doc`` (``what``: which page quotes which data file)."""
    missing = [line for line in expected if line not in doc]
    assert not missing, f"{what}: {missing}"


@pytest.fixture(scope="module")
def engine() -> dict:
    return json.loads((ROOT / "docs/results/engine/bench_engine.json").read_text())


def test_engine_figures_in_bench_md_come_from_the_engine_benchmark(engine: dict) -> None:
    doc = (ROOT / "docs/bench.md").read_text()
    landed = engine["landed"]
    same = engine["same_arithmetic"]
    sweep = engine["sweep"]
    one = engine["one_cell_site_processes"]
    old_per_hour = 3600.0 / landed["seconds"]
    new_per_hour = sweep["cells"] * 3600.0 / sweep["cell_seconds"]
    speedup = new_per_hour / old_per_hour
    expected = [
        f"| {landed['seconds']:.1f} | {old_per_hour:.1f} | {landed['test_auc']:.4f} |",
        f"| {same['seconds']:.1f} | | {same['test_auc']:.4f} (bit-identical) |",
        f"| {sweep['cell_seconds']:.1f} | {new_per_hour:.1f} | {sweep['results'][0]['test_auc']:.4f} |",
        f"| {one['seconds']:.1f} | | {one['test_auc']:.4f} |",
        f"**{speedup:.2f}x** ({new_per_hour:.2f} / {old_per_hour:.2f} = {speedup:.3f} cells/hour)",
        f"takes **{one['seconds']:.1f} s** on its own",
        f"({engine['site_processes_start_seconds']:.1f} s)",
        f"by {abs(sweep['results'][0]['test_auc'] - landed['test_auc']):.3f} on this cell",
    ]
    _assert_quoted(doc, expected, "docs/bench.md does not quote docs/results/engine/bench_engine.json")
    # the landed arithmetic must reproduce the landed engine's metrics exactly
    assert same["test_auc"] == landed["test_auc"]
    assert same["test_loss"] == landed["test_loss"]


def _sensitivity_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "feddraw_sensitivity", ROOT / "benchmarks/feddraw_sensitivity.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_feddraw_study_in_methods_md_comes_from_its_json():
    study = json.loads((ROOT / "docs/results/feddraw-sensitivity/feddraw_sensitivity.json").read_text())
    doc = (ROOT / "docs/methods.md").read_text()
    assert _sensitivity_module().markdown_table(study) in doc
    v = study["variants"]
    best = v["feddraw:similarity=direction,spread=softmax,prior_factor=2"]
    literal, fedavg = v["feddraw"], v["fedavg"]
    expected = [
        f"(+{best['mean_auc'] - literal['mean_auc']:.3f} over the literal reading, "
        f"+{best['mean_auc'] - fedavg['mean_auc']:.3f} over",
        f"share (0.{round(best['smallest_site_mean_share'] * 1000):03d} against "
        f"{best['smallest_site_data_share']:.3f}; the literal reading gave it {literal['smallest_site_mean_share']:.3f})",
        f"Its largest share, {best['smallest_site_max_share']:.3f}",
    ]
    _assert_quoted(doc, expected, "docs/methods.md does not quote feddraw_sensitivity.json")


def test_effects_scoring_figures_in_bench_md_come_from_its_benchmark():
    bench = json.loads((ROOT / "docs/results/engine/bench_effects.json").read_text())
    doc = " ".join((ROOT / "docs/bench.md").read_text().split())
    expected = [
        f"**{bench['new_seconds_jobs']:.1f} s** with {bench['jobs']} processes",
        f"against **{bench['landed_seconds']:.1f} s** before (**{bench['speedup_jobs']:.2f}x**)",
        f"{bench['speedup_one_process']:.1f} times faster per process",
        f"that run's {bench['cells']} cells",
    ]
    _assert_quoted(doc, expected, "docs/bench.md does not quote docs/results/engine/bench_effects.json")
    assert bench["identical"] is True


def _minutes(seconds: float) -> str:
    whole = int(round(seconds))
    return f"{whole // 60} min {whole % 60} s"


def test_suite_times_in_testing_md_come_from_the_measured_runs():
    runs = json.loads((ROOT / "docs/results/suite/suite_timing.json").read_text())
    doc = " ".join((ROOT / "docs/testing.md").read_text().split())
    before, after = runs["runs"]["ci_before"], runs["runs"]["ci_after"]
    cpu = runs["simulator_run_cpu_seconds"]
    expected = [
        f"**{_minutes(after['command_seconds'])}** in all",
        f"**{after['pytest_seconds']:.1f} s ({_minutes(after['pytest_seconds'])})** for {after['tests_passed']:,} tests",
        f"took {_minutes(before['command_seconds'])} (pytest {before['pytest_seconds']:.1f} s",
        f"does not help ({runs['runs']['pytest_four_workers']['pytest_seconds']:.1f} s)",
        f"took {cpu['default_openmp_threads']:.0f} s of CPU, now {cpu['one_openmp_thread']:.1f} s",
    ]
    now, trimmed = runs["runs"]["pytest_current"], runs["runs"]["make_test_after_trim"]
    total = trimmed["tests_passed"] + trimmed["tests_failed"]
    idle = runs["runs"]["make_test_idle"]
    span = f"{now['pytest_seconds'] / 60:.1f}-{trimmed['pytest_seconds'] / 60:.1f} minutes"
    expected += [
        f"**{now['pytest_seconds']:.1f} s ({_minutes(now['pytest_seconds'])})** for {now['tests_passed']:,} tests",
        f"{now['user_cpu_seconds'] + now['system_cpu_seconds']:,.0f} s of CPU",
        f"{trimmed['pytest_seconds']:.1f} s ({_minutes(trimmed['pytest_seconds'])})** for {total:,} tests",
        f"{trimmed['user_cpu_seconds'] + trimmed['system_cpu_seconds']:,.0f} s of CPU",
        f"everything ({total:,} tests)",
        f"{span}, plus",
        f"**{idle['pytest_seconds']:.1f} s ({_minutes(idle['pytest_seconds'])})** for {idle['tests_passed']:,} tests",
        f"{idle['user_cpu_seconds'] + idle['system_cpu_seconds']:,.0f} s of CPU.",
    ]
    latest = runs["runs"]["make_test_mutation_stop"]
    expected += [
        f"**{latest['pytest_seconds']:.1f} s ({_minutes(latest['pytest_seconds'])})** for {latest['tests_passed']:,} tests",
        f"{latest['user_cpu_seconds'] + latest['system_cpu_seconds']:,.0f} s of CPU, above the 15 minutes",
    ]
    _assert_quoted(doc, expected, "docs/testing.md does not quote docs/results/suite/suite_timing.json")
    assert after["pytest_seconds"] < before["pytest_seconds"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"({span} on two cores" in readme


def _precision_lines(data: dict) -> list[str]:
    """docs/privacy.md "Decrypted values are rounded": its table and noise figures, from the run's JSON."""
    runs, bits, low = data["runs"], data["default_bits"], data["min_bits"]
    labels = {
        "full precision": "full precision",
        "default": f"rounded to 2^-{bits} (default)",
        "coarsest": f"rounded to 2^-{low} (coarsest allowed)",
        "CKKS-sized noise": f"N(0, {runs['CKKS-sized noise']['noise_sd']:.0e}) added instead (the CKKS noise's size)",
    }
    lines = []
    for key, label in labels.items():
        run = runs[key]
        aucs = ", ".join(f"{r['test_auc']:.4f}" for r in run["rounds"])
        diff = run.get("max_abs_test_auc_difference")
        shown = "-" if diff is None else f"{diff:.3f}"
        lines.append(f"| {label} | {run['max_abs_change']:.2g} | {aucs} | {shown} |")
    rounds = data["ckks_noise"]["rounds"]
    first, last = rounds[0], rounds[-1]
    shares = [r[f"share_rounding_changed_by_noise_b{bits}"] for r in rounds]
    fine = max(r["share_rounding_changed_by_noise_b20"] for r in rounds)
    coarse = max(r[f"share_rounding_changed_by_noise_b{low}"] for r in rounds)
    return [
        *lines,
        f"after one round {first['max_abs_noise']:.2g} at most (rms {first['rms_noise']:.2g}), after "
        f"{last['round']} rounds {last['max_abs_noise']:.2g} (rms {last['rms_noise']:.2g})",
        f"{100 * sum(shares) / len(shares):.3f} % of the values on average over the {len(rounds)} rounds, "
        f"{100 * max(shares):.3f} % at most",
        f"(b = 20: {100 * fine:.2f} % at most; b = {low}: {100 * coarse:.2f} %)",
    ]


def test_precision_figures_in_privacy_md_come_from_the_precision_benchmark() -> None:
    from fedweigh.secure.precision import DEFAULT_PRECISION_BITS, MIN_PRECISION_BITS

    data = json.loads((ROOT / "docs/results/security/he-precision.json").read_text())
    assert (data["default_bits"], data["min_bits"]) == (DEFAULT_PRECISION_BITS, MIN_PRECISION_BITS)
    _assert_quoted(
        (ROOT / "docs/privacy.md").read_text(),
        _precision_lines(data),
        "docs/privacy.md quotes docs/results/security/he-precision.json",
    )


def test_readme_cpu_install_sizes_come_from_the_measured_installs():
    data = json.loads((ROOT / "docs/results/install/install-size.json").read_text())
    by = {v["variant"]: v for v in data["variants"]}
    cpu, cuda = by["cpu"], by["cuda"]
    # what makes the CPU install one: no CUDA package, and the demo ran in it
    assert cpu["cuda_distributions"] == [] and cpu["torch"].endswith("+cpu")
    assert cpu["demo"]["returncode"] == 0 and any("model:" in line for line in cpu["demo"]["last_lines"])
    assert cuda["cuda_distributions"] and cuda["venv_mib"] > cpu["venv_mib"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    expected = [
        f"with torch {cpu['torch']} the venv takes **{cpu['venv_mib']:,.0f} MiB** (torch {cpu['largest_mib']['torch']:.0f} MiB)",
        f"with PyPI's default torch {cuda['torch']} it takes **{cuda['venv_mib']:,.0f} MiB**",
        f"the {len(cuda['cuda_distributions'])} CUDA packages take {cuda['largest_mib']['nvidia']:,.0f} MiB (`nvidia`)",
        f"and {cuda['largest_mib']['triton']:,.0f} MiB (`triton`)",
        f"`fedweigh --version` took {cpu['version_s']:.2f} s",
        re.sub(r" --workdir \S+", "", data["command"]),  # where the venvs went is the machine's
    ]
    _assert_quoted(readme, expected, "README.md does not quote docs/results/install/install-size.json")
