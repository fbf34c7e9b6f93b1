"""The committed mutation score (docs/results/mutations/score.json, `make mutation`) belongs to today's code.

Rule: a module's score holds for the file it was measured on. The report records the sha256 of every
module it ran; when the file changes, the score is stale: ``make mutation`` (and ``make mutation-stale``)
says so, naming the command that measures it again (``make mutation MODULES=<module>``). A stale score is
no failure of the code, so this suite checks only that the staleness is reported, not that no score is. Every module of ``[tool.mutmut] only_mutate``
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


def test_stale_names_each_module_changed_since_its_run_and_the_command_that_measures_it_again(capsys):
    module = sorted(RUN)[0]
    payload = {"modules": {module: RUN[module]}}
    as_run = json.loads(json.dumps(payload))
    as_run["modules"][module]["after"]["sha256"] = SCORE.file_sha256(module)
    assert SCORE.stale_modules(as_run) == {}
    changed = json.loads(json.dumps(as_run))
    changed["modules"][module]["after"]["sha256"] = "0" * 64
    assert SCORE.stale_modules(changed) == {module: f"make mutation MODULES={module}"}
    assert SCORE.print_stale(changed) == SCORE.stale_modules(changed)
    assert f"mutation score of {module} is stale" in capsys.readouterr().out
    SCORE.print_stale(as_run)
    assert "every measured module is as it was" in capsys.readouterr().out
    gone = {"modules": {"custom/fedweigh/no_such_module.py": RUN[module]}}
    assert list(SCORE.stale_modules(gone)) == ["custom/fedweigh/no_such_module.py"]
    never_run = {"modules": {module: {"status": "not yet run"}}}
    assert SCORE.stale_modules(never_run) == {}


def test_make_mutation_says_which_scores_are_stale_and_make_test_does_not_check_them():
    makefile = (ROOT / "Makefile").read_text()
    mutation = re.search(r"^mutation: (.*)$", makefile, re.M)
    assert mutation and "mutation-stale" in mutation.group(1).split()
    assert re.search(r"^mutation-stale: .*\n\t.*mutation_score\.py stale$", makefile, re.M)
    test = re.search(r"^test: .*\n\t(.*)$", makefile, re.M)
    assert test and "mutation" not in test.group(1)


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


def _is_slow(source: str, test: str | None) -> bool:
    """Whether the test of ``source`` (with no name: the test module) is marked slow, itself or its module."""
    if re.search(r"^pytestmark = .*mark\.slow", source, re.M):
        return True
    if test is None:
        return False
    match = re.search(rf"((?:^@.*\n)*)^def {test}\(", source, re.M)
    return bool(match) and "mark.slow" in match.group(1)


def test_every_kill_on_record_is_by_a_fast_test():
    """The fast suite catches what the report says is caught: each survivor a later test kills names one
    that ``make test-fast`` runs (not marked slow), so the slow suite catches nothing beyond it there."""
    for module, entry in MEASURED.items():
        for item in entry["survivors"] + entry["caught_since_before"]:
            match = KILLED_BY.fullmatch(item["verdict"])
            if match:
                path, test = match.groups()
                assert not _is_slow((ROOT / path).read_text(), test), (
                    module,
                    item["mutant"],
                    item["verdict"],
                )


def test_the_slow_marker_is_read_from_a_test_and_from_its_module():
    bench = (ROOT / "tests" / "test_bench.py").read_text()
    assert _is_slow(bench, "test_process_pool_gives_the_serial_results_on_digits")
    assert not _is_slow(bench, "test_engine_layout_keeps_every_core_busy")
    assert "def test_engine_layout_keeps_every_core_busy(" in bench
    module = "import pytest\n\npytestmark = pytest.mark.slow\n\n\ndef test_a():\n    pass\n"
    assert _is_slow(module, "test_a") and _is_slow(module, None)
    assert not _is_slow(module.replace("mark.slow", "mark.timeout(9)"), "test_a")


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


def _recheck_setting(tmp_path, monkeypatch, module: str, codes: dict[str, int]) -> tuple[dict, list]:
    """A record of ``module`` with 8 caught and 3 survivors (one equivalent, two with a killing test named),
    in a results folder under ``tmp_path``; mutmut's run replaced by one that writes ``codes`` to the meta
    file and records its command."""
    mutant = (SCORE.import_name(module) + ".x_f__mutmut_{}").format
    survivors = [
        {
            "mutant": mutant(1),
            "status": "survived",
            "diff": "-a\n+b",
            "verdict": "equivalent: no test sees it",
        },
        {
            "mutant": mutant(2),
            "status": "survived",
            "diff": "-c\n+d",
            "verdict": "killed by tests/test_x.py::t",
        },
        {
            "mutant": mutant(3),
            "status": "no tests",
            "diff": "-e\n+f",
            "verdict": "killed by tests/test_x.py::u",
        },
    ]
    counts = {"killed": 7, "timeout": 1, "survived": 2, "no_tests": 1, "total": 11, "caught": 8}
    after = {
        "sha256": SCORE.file_sha256(module),
        "run_at": "2026-12-01T00:00:00Z",
        "seconds": 10.0,
        "mutant_seconds": 5.0,
        "counts": counts,
        "score": 72.7,
        "survivors": [s["mutant"] for s in survivors],
    }
    entry = {
        "status": SCORE.RUN_OPEN,
        "before": json.loads(json.dumps(after)),
        "after": after,
        "survivors": survivors,
        "caught_since_before": [],
        "rewritten_since_before": [],
    }
    verdicts = {
        s["mutant"]: {"module": module, "diff": s["diff"], "verdict": s["verdict"]} for s in survivors
    }
    header = {k: v for k, v in REPORT.items() if k != "modules"}
    (tmp_path / "score.json").write_text(json.dumps(header | {"modules": {module: entry}}))
    (tmp_path / "verdicts.json").write_text(json.dumps(verdicts))
    (tmp_path / "testing.md").write_text("")
    for name in ("SCORE_JSON", "VERDICTS"):
        monkeypatch.setattr(SCORE, name, tmp_path / getattr(SCORE, name).name)
    monkeypatch.setattr(SCORE, "SCORE_MD", tmp_path / "score.md")
    monkeypatch.setattr(SCORE, "TESTING_MD", tmp_path / "testing.md")
    monkeypatch.setattr(SCORE, "STAGE", tmp_path / "stage")
    monkeypatch.setattr(SCORE, "MUTANTS", tmp_path / "stage" / "mutants")
    monkeypatch.setattr(SCORE, "stage", lambda: None)
    commands = []

    def mutmut_run(command, **_):
        commands.append(command)
        SCORE.meta_path(module).parent.mkdir(parents=True, exist_ok=True)
        SCORE.meta_path(module).write_text(json.dumps({"exit_code_by_key": codes}))
        return SCORE.subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(SCORE.subprocess, "run", mutmut_run)
    return entry, commands


def test_a_recheck_counts_the_survivors_mutmut_now_catches_and_reopens_a_kill_it_does_not_confirm(
    tmp_path, monkeypatch
):
    module = "custom/fedweigh/schedules.py"
    name = (SCORE.import_name(module) + ".x_f__mutmut_{}").format
    entry, commands = _recheck_setting(tmp_path, monkeypatch, module, {name(1): 0, name(2): 1, name(3): 0})
    got = SCORE.recheck(module, nice=15, jobs=2)
    assert len(commands) == 1 and commands[0][-2:] == [name(2), name(3)]  # not the equivalent one
    assert commands[0][commands[0].index("--max-children") + 1] == "2"
    assert got["after"]["counts"] == {"killed": 8, "timeout": 1, "survived": 2, "total": 11, "caught": 9}
    assert got["after"]["score"] == 81.8 and got["before"] == entry["before"]
    assert got["after"]["survivors"] == [name(1), name(3)] == [s["mutant"] for s in got["survivors"]]
    assert got["survivors"][1]["status"] == "survived" and got["survivors"][1]["verdict"] == "open"
    assert got["caught_since_before"] == [
        {"mutant": name(2), "diff": "-c\n+d", "verdict": "killed by tests/test_x.py::t"}
    ]
    assert got["after"]["rechecked"][0]["mutants"] == 2
    assert got["after"]["rechecked"][0]["caught"] == [name(2)]
    assert got["status"] == SCORE.RUN_OPEN  # name(3) is open again
    saved = json.loads((tmp_path / "score.json").read_text())["modules"][module]
    assert saved == got
    assert json.loads((tmp_path / "verdicts.json").read_text())[name(3)]["verdict"] == "open"
    assert "81.8%" in (tmp_path / "score.md").read_text()
    assert "1 of its 2 undecided survivors caught" in (tmp_path / "score.md").read_text()


def test_a_recheck_that_catches_every_undecided_survivor_leaves_the_module_run(tmp_path, monkeypatch):
    module = "custom/fedweigh/schedules.py"
    name = (SCORE.import_name(module) + ".x_f__mutmut_{}").format
    _recheck_setting(tmp_path, monkeypatch, module, {name(1): 0, name(2): 1, name(3): 36})
    got = SCORE.recheck(module, nice=15)
    assert got["after"]["counts"] == {"killed": 8, "timeout": 2, "survived": 1, "total": 11, "caught": 10}
    assert got["status"] == SCORE.RUN and [s["mutant"] for s in got["survivors"]] == [name(1)]


def test_a_recheck_refuses_a_module_changed_since_its_run(tmp_path, monkeypatch):
    module = "custom/fedweigh/schedules.py"
    entry, commands = _recheck_setting(tmp_path, monkeypatch, module, {})
    entry["after"]["sha256"] = "0" * 64
    (tmp_path / "score.json").write_text(json.dumps({"modules": {module: entry}}))
    with pytest.raises(SystemExit, match="changed since its last run"):
        SCORE.recheck(module, nice=15)
    assert not commands
