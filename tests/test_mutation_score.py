"""The committed mutation score (docs/results/mutations/score.json, `make mutation`) belongs to today's code.

Rule: a module's score holds for the file it was measured on. The report records the sha256 of every
module it ran; when the file changes, the score is stale and this test fails, naming the command that
measures it again (``make mutation MODULES=<module>``). Every module of ``[tool.mutmut] only_mutate``
(what ``make mutation`` runs) is in the report, run or marked "not yet run"; every mutant the tests did
not catch has a verdict (``equivalent: <reason>``, not ``open``); a survivor of the first run that a
later run caught names the test that kills it, and that test exists; score.md and the table of
docs/testing.md are the ones score.json gives.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "mutations"


def _module():
    spec = importlib.util.spec_from_file_location("mutation_score", ROOT / "benchmarks" / "mutation_score.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


SCORE = _module()
REPORT = json.loads((RESULTS / "score.json").read_text())
VERDICTS = json.loads((RESULTS / "verdicts.json").read_text())
RUN = {module: entry for module, entry in REPORT["modules"].items() if entry["status"] == "run"}
KILLED_BY = re.compile(
    r"killed by (tests/test_\w+\.py)::(\w+)(?:\[[^\]]+\])?"
)  # a parametrized case names its id


def test_the_report_lists_exactly_the_modules_make_mutation_runs():
    assert SCORE.configured_modules(), "[tool.mutmut] only_mutate matches no module"
    assert sorted(REPORT["modules"]) == SCORE.configured_modules()
    for module in REPORT["modules"]:
        assert (ROOT / module).is_file(), f"{module} is in the mutation report but no longer exists"
    assert RUN, "no module has a measured score"


@pytest.mark.parametrize("module", sorted(RUN) or ["none"])
def test_each_score_was_measured_on_the_module_as_it_is_now(module):
    recorded = RUN[module]["after"]["sha256"]
    assert recorded == SCORE.file_sha256(module), (
        f"{module} changed since its mutation score was measured: run `make mutation MODULES={module}` "
        "and commit docs/results/mutations/ (score.json, score.md, verdicts.json) and the table in docs/testing.md"
    )


def test_the_counts_add_up_to_the_score():
    for module, entry in RUN.items():
        for run in (entry["before"], entry["after"]):
            counts = run["counts"]
            assert counts["caught"] == sum(counts.get(s, 0) for s in SCORE.CAUGHT), module
            assert counts["total"] == sum(v for k, v in counts.items() if k not in ("total", "caught")), (
                module
            )
            assert run["score"] == round(100.0 * counts["caught"] / counts["total"], 1), module
            assert len(run["survivors"]) == counts["total"] - counts["caught"], module
        assert [s["mutant"] for s in entry["survivors"]] == entry["after"]["survivors"], module


def test_every_mutant_not_caught_has_a_verdict():
    for module, entry in RUN.items():
        for survivor in entry["survivors"]:
            name = survivor["mutant"]
            assert (
                VERDICTS[name]["diff"] == survivor["diff"]
                and VERDICTS[name]["verdict"] == survivor["verdict"]
            )
            assert re.fullmatch(r"equivalent: \S.{10,}", survivor["verdict"], re.S), (
                f"{module}: {name} survives with verdict {survivor['verdict']!r}; decide it in "
                "docs/results/mutations/verdicts.json: a test that kills it, or 'equivalent: <reason>'"
            )


def test_a_survivor_caught_later_names_an_existing_test_that_kills_it():
    for module, entry in RUN.items():
        caught = {c["mutant"] for c in entry["caught_since_before"]}
        rewritten = {c["mutant"] for c in entry.get("rewritten_since_before", [])}
        assert not caught & rewritten, module
        assert caught | rewritten == set(entry["before"]["survivors"]) - set(entry["after"]["survivors"]), (
            module
        )
        for item in entry.get("rewritten_since_before", []):  # gone with the code it changed: no test to name
            assert item["verdict"].startswith("rewritten: "), item
        for item in entry["caught_since_before"]:
            match = KILLED_BY.fullmatch(item["verdict"])
            assert match, f"{module}: {item['mutant']} was caught later; its verdict must name the test"
            path, test = match.groups()
            assert re.search(rf"^def {test}\(", (ROOT / path).read_text(), re.M), item["verdict"]


def test_score_md_and_the_testing_page_show_the_committed_scores():
    assert (RESULTS / "score.md").read_text() == SCORE.markdown(REPORT)
    assert SCORE.table(REPORT) in (ROOT / "docs" / "testing.md").read_text()


def test_the_slow_check_found_nothing_the_fast_tests_miss():
    """docs/results/mutations/slow_check.json: per module checked, the slow tests passed with no mutant,
    failed on every control (so the mutated code reaches them), and passed on every mutant the fast tests
    let through, which are exactly the module's survivors in the report, measured on the same file."""
    checks = json.loads((RESULTS / "slow_check.json").read_text())
    assert checks, "no slow check is recorded"
    for module, check in checks.items():
        entry = REPORT["modules"][module]
        assert check["sha256"] == entry["after"]["sha256"] == SCORE.file_sha256(module), module
        runs = check["runs"]
        assert [r["role"] for r in runs[:1]] == ["control: no mutant"] and runs[0]["returncode"] == 0, module
        controls = [r for r in runs if r["role"] == "control: caught by the fast tests"]
        assert controls and all(r["returncode"] != 0 and r["failed"] for r in controls), module
        missed = [r for r in runs if r["role"] == "not caught by the fast tests"]
        assert sorted(r["mutant"] for r in missed) == sorted(entry["after"]["survivors"]), module
        assert all(r["returncode"] == 0 for r in missed), (
            f"{module}: a slow test catches what the fast tests miss"
        )
