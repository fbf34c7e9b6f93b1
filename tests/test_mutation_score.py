"""The committed mutation score (docs/results/mutations/score.json, `make mutation`) belongs to today's code.

Rule: a module's score holds for the file it was measured on. The report records the sha256 of every
module it ran; when the file changes, the score is stale and this test fails, naming the command that
measures it again (``make mutation MODULES=<module>``). Every module of ``[tool.mutmut] only_mutate``
(what ``make mutation`` runs) is in the report, run or marked "not yet run"; every mutant the tests did
not catch has a verdict (``equivalent: <reason>``, not ``open``), except in a module marked
``run, survivors open``, whose score is measured and whose open survivors are still to decide; a survivor of the first run that a
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
MEASURED = {module: entry for module, entry in REPORT["modules"].items() if SCORE.was_run(entry)}
RUN = {module: entry for module, entry in MEASURED.items() if entry["status"] == SCORE.RUN}
KILLED_BY = re.compile(
    r"killed by (tests/test_\w+\.py)(?:::(\w+)(?:\[[^\]]+\])?| " + re.escape(SCORE.IMPORT_FAILS) + ")"
)  # a parametrized case names its id; a mutant that breaks the import of the tests names their module


def _names_a_test(verdict: str) -> bool:
    """Whether a ``killed by`` verdict names an existing test (or an existing test module)."""
    match = KILLED_BY.fullmatch(verdict)
    if not match:
        return False
    path, test = match.groups()
    source = (ROOT / path).read_text()
    return test is None or bool(re.search(rf"^def {test}\(", source, re.M))


def test_the_report_lists_exactly_the_modules_make_mutation_runs():
    assert SCORE.configured_modules(), "[tool.mutmut] only_mutate matches no module"
    assert sorted(REPORT["modules"]) == SCORE.configured_modules()
    for module in REPORT["modules"]:
        assert (ROOT / module).is_file(), f"{module} is in the mutation report but no longer exists"
    assert RUN, "no module has a measured score"


@pytest.mark.parametrize("module", sorted(MEASURED) or ["none"])
def test_each_score_was_measured_on_the_module_as_it_is_now(module):
    recorded = MEASURED[module]["after"]["sha256"]
    assert recorded == SCORE.file_sha256(module), (
        f"{module} changed since its mutation score was measured: run `make mutation MODULES={module}` "
        "and commit docs/results/mutations/ (score.json, score.md, verdicts.json) and the table in docs/testing.md"
    )


def test_the_counts_add_up_to_the_score():
    for module, entry in MEASURED.items():
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


def test_a_module_with_an_open_survivor_says_so_and_nothing_else_is_undecided():
    """A module is ``run`` only when every survivor is decided equivalent; ``run, survivors open`` lists its
    survivors with the verdicts recorded so far: ``open``, equivalent, or killed by an existing test in a
    ``try`` (the next run confirms it), at least one of them not equivalent."""
    for module, entry in MEASURED.items():
        decided = [
            bool(re.fullmatch(r"equivalent: \S.{10,}", s["verdict"], re.S)) for s in entry["survivors"]
        ]
        named = [c["verdict"] != "open" for c in entry["caught_since_before"]]
        assert entry["status"] == (SCORE.RUN if all(decided) and all(named) else SCORE.RUN_OPEN), module
        for survivor in entry["survivors"]:
            name, verdict = survivor["mutant"], survivor["verdict"]
            assert VERDICTS[name]["verdict"] == verdict, name
            if KILLED_BY.fullmatch(verdict):
                assert _names_a_test(verdict), verdict
            else:
                assert verdict == "open" or verdict.startswith("equivalent: "), (module, name, verdict)


def test_a_survivor_caught_later_names_an_existing_test_that_kills_it():
    for module, entry in MEASURED.items():
        caught = {c["mutant"] for c in entry["caught_since_before"]}
        rewritten = {c["mutant"] for c in entry.get("rewritten_since_before", [])}
        assert not caught & rewritten, module
        assert caught | rewritten == set(entry["before"]["survivors"]) - set(entry["after"]["survivors"]), (
            module
        )
        for item in entry.get("rewritten_since_before", []):  # gone with the code it changed: no test to name
            assert item["verdict"].startswith("rewritten: "), item
        for item in entry["caught_since_before"]:
            if entry["status"] == SCORE.RUN_OPEN and item["verdict"] == "open":
                continue  # caught by the last run, the test that kills it still to be named
            assert KILLED_BY.fullmatch(item["verdict"]), (
                f"{module}: {item['mutant']} was caught later; its verdict must name the test"
            )
            assert _names_a_test(item["verdict"]), item["verdict"]


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


def test_a_report_rebuilt_without_a_modules_results_keeps_its_record_with_todays_verdicts(
    tmp_path, monkeypatch
):
    """A fresh clone has no build/mutation/: ``report`` keeps each run module's last record (not "no
    mutants"), takes the verdicts decided since from verdicts.json, and sets the status they give."""
    module = next(m for m, e in MEASURED.items() if e["survivors"])
    entry = json.loads(json.dumps(MEASURED[module]))
    first = entry["survivors"][0]
    for s in entry["survivors"]:
        s["verdict"] = "open"
    entry["status"] = SCORE.RUN_OPEN
    verdicts = {
        s["mutant"]: {"module": module, "diff": s["diff"], "verdict": "open"} for s in entry["survivors"]
    }
    verdicts[first["mutant"]]["verdict"] = "equivalent: decided by hand since the run"
    (tmp_path / "score.json").write_text(json.dumps({"modules": {module: entry}}))
    (tmp_path / "verdicts.json").write_text(json.dumps(verdicts))
    monkeypatch.setattr(SCORE, "SCORE_JSON", tmp_path / "score.json")
    monkeypatch.setattr(SCORE, "VERDICTS", tmp_path / "verdicts.json")
    monkeypatch.setattr(SCORE, "SCORE_MD", tmp_path / "score.md")
    monkeypatch.setattr(SCORE, "TESTING_MD", tmp_path / "testing.md")
    monkeypatch.setattr(SCORE, "MUTANTS", tmp_path / "no-mutants")
    monkeypatch.setattr(SCORE, "configured_modules", lambda: [module])
    (tmp_path / "testing.md").write_text("")
    kept = SCORE.report()["modules"][module]
    assert kept["after"] == entry["after"] and kept["before"] == entry["before"]
    assert kept["survivors"][0]["verdict"] == "equivalent: decided by hand since the run"
    assert kept["status"] == (SCORE.RUN_OPEN if len(entry["survivors"]) > 1 else SCORE.RUN)
    for s in kept["survivors"][1:]:
        s["verdict"] = "equivalent: decided by hand since the run"
    verdicts = {
        s["mutant"]: {"module": module, "diff": s["diff"], "verdict": s["verdict"]} for s in kept["survivors"]
    }
    (tmp_path / "verdicts.json").write_text(json.dumps(verdicts))
    assert SCORE.report()["modules"][module]["status"] == SCORE.RUN


def test_try_reads_failed_erred_and_uncollectable_tests_from_pytests_summary():
    summary = "\n".join(
        [
            "FAILED tests/test_a.py::test_one - AssertionError: 1 != 2",
            "FAILED tests/test_a.py::test_two[case-1] - ValueError",
            "ERROR tests/test_b.py::test_three - fixture broke",
            "ERROR tests/test_c.py - TypeError: startswith first arg must be str",
            "ERROR tests/test_d.py",
            "PASSED tests/test_e.py::test_four",
            "  FAILED tests/test_f.py::test_indented",
        ]
    )
    assert SCORE.failed_tests(summary) == [
        "tests/test_a.py::test_one",
        "tests/test_a.py::test_two[case-1]",
        "tests/test_b.py::test_three",
        f"tests/test_c.py {SCORE.IMPORT_FAILS}",
        f"tests/test_d.py {SCORE.IMPORT_FAILS}",
    ]
    assert SCORE.failed_tests("5 passed in 0.1s") == []
    assert KILLED_BY.fullmatch(f"killed by tests/test_c.py {SCORE.IMPORT_FAILS}")
    assert not KILLED_BY.fullmatch("killed by tests/test_c.py")
