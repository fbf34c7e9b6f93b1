"""Mutation check: change one thing in a scratch copy of the code and run the tests that should notice.

Each entry of :data:`MUTATIONS` replaces one piece of the package (or of the packaging) by a broken
version and names the tests that guard it. For each, the working tree (tracked and untracked,
not-ignored files) is copied into a scratch folder, the edit is applied there (the text must occur
exactly once), and pytest runs the named tests in that copy with the copy's package first on the
path. A mutation is *caught* when at least one of its tests fails; it *survives* when they all pass.

    PYTHONPATH=custom .venv/bin/python benchmarks/mutation_check.py --out mutations.json
    PYTHONPATH=custom .venv/bin/python benchmarks/mutation_check.py --check          # edits apply?
    PYTHONPATH=custom .venv/bin/python benchmarks/mutation_check.py --only dp-sgd-noise-constant
    PYTHONPATH=custom .venv/bin/python benchmarks/mutation_check.py \\
        --markdown docs/results/mutations/mutations.json                # docs/testing.md's table

The last line is ``mutations: N tried, N caught, N survived``; ``--out`` writes each mutation with
its tests, the tests that failed, pytest's exit code and the time taken. Generated test data are
shared with the working tree (``FEDWEIGH_CACHE``), so a copy builds none of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    """Replace ``old`` (exactly one occurrence) by ``new`` in ``path``; ``tests`` must then fail."""

    name: str
    breaks: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "resume-ignored",
        "resume_from is ignored: the second part trains from scratch",
        "custom/fedweigh/flare/controller.py",
        "        if self.resume_from:\n            last, params, rows = self._load_state(self.resume_from)",
        "        if False:\n            last, params, rows = self._load_state(self.resume_from)",
        (
            "tests/test_resume.py::test_stopped_and_resumed_fedadp_trains_only_the_last_round_from_the_saved_state",
        ),
    ),
    Mutation(
        "resume-scheme-state-dropped",
        "resume_from restores the model and rows but not the scheme's cross-round state (FedAdp's angles)",
        "custom/fedweigh/flare/controller.py",
        '        self._scheme.load_state_dict(state.get("scheme_state") or {})',
        "        self._scheme.load_state_dict({})",
        (
            "tests/test_resume.py::test_stopped_and_resumed_fedadp_trains_only_the_last_round_from_the_saved_state",
        ),
    ),
    Mutation(
        "resume-he-ignored",
        "under HE, resume_from does not restore the encrypted global model",
        "custom/fedweigh/flare/controller.py",
        "        if self.resume_from:\n            he_model.load(",
        "        if False:\n            he_model.load(",
        ("tests/test_resume.py::test_stopped_and_resumed_he_run_continues_from_the_encrypted_state",),
    ),
    Mutation(
        "dp-sgd-noise-constant",
        "DP-SGD noise (and Poisson sampling) seeded with a constant",
        "custom/fedweigh/secure/dp_sgd.py",
        "torch.Generator().manual_seed(secrets.randbits(63))",
        "torch.Generator().manual_seed(12345)",
        (
            "tests/test_privacy.py::test_dp_sgd_noise_is_drawn_afresh_for_every_run_and_round",
            "tests/test_dp_end_to_end.py::test_dp_noise_comes_from_the_operating_system",
        ),
    ),
    Mutation(
        "statistics-dp-noise-rng0",
        "the statistics DP noise drawn from default_rng(0)",
        "custom/fedweigh/secure/gaussian.py",
        "np.random.default_rng(secrets.randbits(128))",
        "np.random.default_rng(0)",
        ("tests/test_privacy.py::test_statistics_noise_is_drawn_afresh_for_every_job_and_site",),
    ),
    Mutation(
        "step-count-unchecked",
        "the server's step-count validation removed",
        "custom/fedweigh/server/validation.py",
        "    num_steps = check_count(site, META_NUM_STEPS, meta.get(META_NUM_STEPS, 1), limits.max_num_steps)",
        "    num_steps = int(meta.get(META_NUM_STEPS, 1))",
        ("tests/test_validation.py",),
    ),
    *(
        Mutation(
            f"kit-marker-{marker.split('.')[0]}-dropped",
            f"{marker} no longer marks a provisioned kit (simulation keys accepted there)",
            "custom/fedweigh/secure/contexts.py",
            'PROVISIONED_MARKERS = ("fed_server.json", "fed_client.json", "rootCA.pem")',
            "PROVISIONED_MARKERS = ("
            + ", ".join(f'"{m}"' for m in ("fed_server.json", "fed_client.json", "rootCA.pem") if m != marker)
            + ")",
            ("tests/test_secure.py",),
        )
        for marker in ("fed_server.json", "fed_client.json", "rootCA.pem")
    ),
    Mutation(
        "fedavg-uniform-weights",
        "FedAvg weights 1/K instead of N_k / N",
        "custom/fedweigh/weighting/fedavg.py",
        "        w = n / n.sum()",
        "        w = np.full(len(n), 1.0 / len(n))",
        (
            "tests/test_parity_stock_fedavg.py::test_fedavg_weights_match_stock_fedavg_with_sites_of_different_sizes",
        ),
    ),
    Mutation(
        "he-updates-not-applied",
        "the encrypted sum leaves the global model where it was (the POC's 'model moved' check)",
        "custom/fedweigh/server/encrypted.py",
        "        summed = weighted_sum([c.update for c in contributions], w, base, self.layout.slots)",
        "        summed = weighted_sum([c.update for c in contributions], 0.0 * w, base, self.layout.slots)",
        ("tests/test_poc.py::test_he_model_updates_with_the_kits_contexts",),
    ),
    Mutation(
        "he-updates-scaled",
        "the encrypted sum gives the updates 5% more weight than the plaintext path",
        "custom/fedweigh/server/encrypted.py",
        "        summed = weighted_sum([c.update for c in contributions], w, base, self.layout.slots)",
        "        summed = weighted_sum([c.update for c in contributions], 1.05 * w, base, self.layout.slots)",
        ("tests/test_he_simulator.py::test_he_run_matches_the_plaintext_path",),
    ),
    Mutation(
        "min-clients-ignored",
        "a round with fewer valid results than min_clients still updates the model",
        "custom/fedweigh/server/rounds.py",
        "        if not outcome.reason and len(outcome.reports) < min_clients:",
        "        if False and not outcome.reason and len(outcome.reports) < min_clients:",
        ("tests/test_failures.py::test_invalid_results_are_left_out_with_the_reason_and_the_model_kept",),
    ),
    Mutation(
        "crash-waited-out",
        "a crashed site is waited for until train_timeout instead of being skipped at once",
        "custom/fedweigh/flare/controller.py",
        "        results = c.ask_sites(TASK_TRAIN, model, task.targets, c.min_clients)",
        "        results = c.ask_sites(TASK_TRAIN, model, task.targets, c.min_clients)\n"
        "        if c.train_timeout and len(results) < len(task.targets):\n"
        "            time.sleep(c.train_timeout)",
        ("tests/test_failures.py::test_crashing_site_is_left_out_at_once_and_the_round_completes",),
    ),
    Mutation(
        "bench-aggregation-rounding",
        "the bench's round step rounds the global model differently from the simulator's (1 ulp)",
        "custom/fedweigh/weighting/base.py",
        "        w = np.asarray(weights, dtype=np.float64)",
        "        w = np.asarray(weights, dtype=np.float64)\n"
        "        w = w * (1 + 1e-7 * ('fedweigh.bench' in sys.modules))",
        ("tests/test_bench_parity.py",),
    ),
    Mutation(
        "weights-plot-drops-last-site",
        "the weights plot leaves the last site out",
        "custom/fedweigh/plots.py",
        "    sites = sorted({s for w in weights for s in w} | set(reference or {}), key=_site_key)",
        "    sites = sorted({s for w in weights for s in w} | set(reference or {}), key=_site_key)[:-1]",
        ("tests/test_recorder.py", "tests/test_weights_plot.py"),
    ),
    Mutation(
        "metric-plot-shifted",
        "the metric-by-round plot draws each value one round late",
        "custom/fedweigh/plots.py",
        '        ax.plot(rounds, values, marker="o", label=name)',
        '        ax.plot(rounds, [values[0], *values[:-1]], marker="o", label=name)',
        ("tests/test_recorder.py",),
    ),
    Mutation(
        "plain-warning-removed",
        "plain statistics no longer warn that histograms travel in clear",
        "custom/fedweigh/flare/statistics.py",
        '    if mode == "plain":\n        controller.warning(',
        "    if False:\n        controller.warning(",
        ("tests/test_controller_run.py::test_plain_statistics_warn_and_secure_ones_do_not",),
    ),
    Mutation(
        "data-path-vars-not-expanded",
        "$VARIABLES in a site's data path are not expanded",
        "custom/fedweigh/site/data_config.py",
        "    expanded = os.path.expandvars(path)",
        "    expanded = path",
        ("tests/test_site_data.py",),
    ),
    Mutation(
        "stats-task-no-timeout",
        "the statistics task waits for every site without train_timeout",
        "custom/fedweigh/flare/statistics.py",
        "    results = controller.ask_sites(TASK_STATS, FLModel(params={}, meta=task_meta), sites, 1)",
        "    results = controller.broadcast_model(task_name=TASK_STATS, data=FLModel(params={}, meta=task_meta), "
        "targets=sites)",
        ("tests/test_controller_run.py::test_train_timeout_applies_to_every_task",),
    ),
    Mutation(
        "memory-gc-ignored",
        "memory_gc_rounds is ignored (memory freed every round)",
        "custom/fedweigh/flare/controller.py",
        "        if every and round_index % every == 0:",
        "        if True:",
        ("tests/test_controller_run.py::test_memory_gc_rounds_frees_memory_in_those_rounds",),
    ),
    Mutation(
        "validate-task-no-timeout",
        "the final validation task waits for every site without train_timeout",
        "custom/fedweigh/flare/controller.py",
        "        results = self.controller.ask_sites(TASK_VALIDATE, final, task.targets, 1)",
        "        results = self.controller.broadcast_model(task_name=TASK_VALIDATE, data=final, targets=task.targets)",
        ("tests/test_controller_run.py::test_train_timeout_applies_to_every_task",),
    ),
    Mutation(
        "he-hospitals-disagree",
        "one hospital's decrypted global model differs from the others' by 1e-6 (the POC's exact agreement)",
        "custom/fedweigh/flare/client.py",
        "        atomic_write_npz(Path(HE_SITE_MODEL_FILE.format(job_id=self.job_id)), **receipt.use)",
        "        kept = receipt.use\n"
        "        if self.site_name.endswith('-b'):\n"
        "            kept = {k: v + (v.dtype.kind == 'f') * v.dtype.type(1e-6) for k, v in kept.items()}\n"
        "        atomic_write_npz(Path(HE_SITE_MODEL_FILE.format(job_id=self.job_id)), **kept)",
        ("tests/test_poc.py::test_he_model_updates_with_the_kits_contexts",),
    ),
    Mutation(
        "aggregator-round-off-by-one",
        "FedweighAggregator weighs round t with round t+1's schedule",
        "custom/fedweigh/flare/aggregator.py",
        "        return min(self._rounds, round_index), self._rounds",
        "        return min(self._rounds, round_index + 1), self._rounds",
        ("tests/test_aggregator.py",),
    ),
    Mutation(
        "demo-table-columns-swapped",
        "fedweigh demo prints validation AUC under test_gm",
        "custom/fedweigh/cli.py",
        "            f\"{r['round']:>5}  {fmt(r.get('test_auc'))}    {fmt(r.get('test_gm'))}    \"",
        "            f\"{r['round']:>5}  {fmt(r.get('test_auc'))}    {fmt(r.get('val_auc'))}    \"",
        ("tests/test_cli.py", "tests/test_demo_progress.py"),
    ),
    Mutation(
        "test-dependency-undeclared",
        "a package the tests import (psutil) is no longer declared in the dev extra",
        "pyproject.toml",
        '    "psutil>=5.9",\n',
        "",
        ("tests/test_packaging.py",),
    ),
)


def working_tree_files(root: Path) -> list[str]:
    """Tracked and untracked, not-ignored files of the repository (what a fresh copy of the work has)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout.decode()
    return [f for f in out.split("\0") if f and (root / f).is_file()]


def scratch_copy(root: Path, dest: Path) -> Path:
    for rel in working_tree_files(root):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
    return dest


def apply(mutation: Mutation, tree: Path) -> None:
    path = tree / mutation.path
    text = path.read_text()
    count = text.count(mutation.old)
    if count != 1:
        raise ValueError(
            f"{mutation.name}: {mutation.path} holds the text to replace {count} times, not once"
        )
    new = text.replace(mutation.old, mutation.new)
    if path.suffix == ".py" and re.search(r"\b(sys|time)\.", mutation.new):
        new = _with_imports(new, "import sys\nimport time\n")
    path.write_text(new)


def _with_imports(text: str, imports: str) -> str:
    """``imports`` after the module's ``from __future__`` line, or at its top without one."""
    match = re.search(r"^from __future__ import .*\n", text, re.M)
    return text[: match.end()] + imports + text[match.end() :] if match else imports + text


def run_tests(mutation: Mutation, tree: Path, timeout: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree / "custom")
    env.setdefault("FEDWEIGH_CACHE", str(ROOT / ".cache" / "test-data"))
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=-ra",
            *mutation.tests,
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    seconds = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.M)))
    first_error = next((line[1:].strip() for line in output.splitlines() if line.startswith("E ")), "")
    return {
        "returncode": proc.returncode,
        "failed": failed,
        "caught": proc.returncode == 1 and bool(failed),
        "first_error": first_error[:300],
        "seconds": round(seconds, 1),
        "last_line": output.strip().splitlines()[-1] if output.strip() else "",
    }


def _short(nodeid: str) -> str:
    """``tests/test_x.py::test_y[p]`` -> ``test_x.py::test_y``."""
    return nodeid.removeprefix("tests/").split("[", 1)[0]


def markdown(results: list[dict]) -> str:
    """docs/testing.md's table of a run: mutation | what it breaks | tests that failed."""
    lines = ["| mutation | what it breaks | tests that failed on it |", "|---|---|---|"]
    for r in results:
        failed = ", ".join(f"`{t}`" for t in dict.fromkeys(_short(t) for t in r["failed"])) or "**none**"
        lines.append(f"| `{r['name']}` | {r['breaks']} | {failed} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations only")
    parser.add_argument("--check", action="store_true", help="only check that every edit applies")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per mutation's tests")
    parser.add_argument("--markdown", metavar="JSON", help="print the docs' table of a run's JSON and stop")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutation(s): {', '.join(sorted(unknown))}")
    results = []
    with tempfile.TemporaryDirectory(prefix="fedweigh-mutation-") as tmp:
        pristine = scratch_copy(ROOT, Path(tmp) / "pristine")
        for m in chosen:
            tree = Path(tmp) / m.name
            shutil.copytree(pristine, tree)
            apply(m, tree)
            if args.check:
                print(f"{m.name}: applies")
                shutil.rmtree(tree)
                continue
            print(f"{m.name}: {m.breaks}; running {' '.join(m.tests)}", flush=True)
            outcome = run_tests(m, tree, args.timeout)
            verdict = "caught" if outcome["caught"] else "SURVIVED" if outcome["returncode"] == 0 else "error"
            print(
                f"  {verdict} in {outcome['seconds']} s: {', '.join(outcome['failed']) or outcome['last_line']}"
            )
            results.append({**asdict(m), **outcome})
            shutil.rmtree(tree)
    if args.check:
        return 0
    caught = sum(r["caught"] for r in results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"mutations: {len(results)} tried, {caught} caught, {len(results) - caught} survived")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
