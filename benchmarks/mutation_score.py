"""Mutation score of the core modules: run mutmut against the fast tests and write the report.

    make mutation                                             # every module of [tool.mutmut] only_mutate
    make mutation MODULES=custom/fedweigh/schedules.py        # one module (a folder: each of its modules)
    PYTHONPATH=custom .venv/bin/python benchmarks/mutation_score.py report   # the report from the last runs
    PYTHONPATH=custom .venv/bin/python benchmarks/mutation_score.py try MUTANT... --tests tests/x.py::test_y
    PYTHONPATH=custom .venv/bin/python benchmarks/mutation_score.py recheck custom/fedweigh/bench/stats.py
    PYTHONPATH=custom .venv/bin/python benchmarks/mutation_score.py stale    # which scores a change made stale

``run`` runs ``mutmut run --max-children 1 <module>.x*`` once per module (``--jobs N``: N mutants at
once), at low priority, and then writes the report. mutmut (3.x) names a mutant after its file's path,
and only a leading ``src/`` maps that path to the import name ``fedweigh.*``; so the run happens in
``build/mutation/``, where ``src`` links to ``custom/``, ``tests`` to ``tests/`` and ``pyproject.toml``
to the project's (its ``[tool.mutmut]`` section). mutmut copies them into ``build/mutation/mutants/`` and puts
``mutants/src`` first on ``sys.path``: the tests import the mutated copy of the package, and mutmut's
forced-failure check (every mutated function raises; some test must fail) stops the run if they do
not. The rest of the project (docs, examples, jobs, ...) is linked into ``mutants/`` for the tests that
read it. Each mutant runs the fast tests that call its function (mutmut's first pass records which),
in one process, in the order they are written (``FEDWEIGH_TEST_ORDER=given``), with Hypothesis
derandomised (``HYPOTHESIS_PROFILE=mutation``) so that every mutant meets the same examples.

``report`` reads mutmut's results (``mutants/**/<module>.py.meta``) and writes
``docs/results/mutations/score.json`` and ``score.md``: per module the counts, the score
(caught / total, caught = killed or timed out), the time taken, the sha256 of the source file as it
was mutated, and every mutant that was not caught with its diff and verdict. Verdicts are kept in
``docs/results/mutations/verdicts.json`` (mutant name -> diff and verdict, edited by hand):
``killed by tests/<file>.py::<test>`` for a survivor a later test kills (``killed by tests/<file>.py
(its import fails with the mutant)`` where the mutant already breaks the import of the tests),
``equivalent: <reason>`` for a change no test can see, ``open`` until one of them is decided (a new survivor is added as ``open``).
A module's first measured run is kept as ``before``; later runs replace ``after``. Modules never run
are listed as ``not yet run``; a module measured while some of its survivors are still ``open`` is listed
as ``run, survivors open`` (its score measured, some mutants still to triage: a survivor neither
equivalent nor caught by a run yet, or a survivor of the first run caught since whose killing test is
not yet named). A report rebuilt where a
run module has no meta file (a fresh clone) keeps that module's last record, with the verdicts of
``verdicts.json``.

``stale`` lists the measured modules whose file changed since their run (its sha256 differs from the
one recorded), each with the command that measures it again; ``make mutation`` prints it before it runs.
A stale score is a reason to rerun, not a failure: ``make test`` does not check it.

``recheck`` runs the survivors of a module's last run that are not decided equivalent through mutmut
again (``mutmut run NAME...``), on the file the run mutated: a survivor a test was written for since
then, and that mutmut's own run now catches, counts as caught (``after["rechecked"]`` records when and
which), without rerunning the rest of the module.

``try`` runs named tests against named mutants of the last run (``MUTANT_UNDER_TEST`` with the mutated
copy first on the path; ``custom/`` is never touched) and, for each mutant the tests fail on while they
pass with no mutant, records ``killed by <the failing test>`` as its verdict: the verdict is measured,
and the module's next ``run`` or ``recheck`` confirms it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from fedweigh.io import atomic_write_json, atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
STAGE = ROOT / "build" / "mutation"
MUTANTS = STAGE / "mutants"
RESULTS = ROOT / "docs" / "results" / "mutations"
SCORE_JSON = RESULTS / "score.json"
SCORE_MD = RESULTS / "score.md"
VERDICTS = RESULTS / "verdicts.json"
MUTMUT = ROOT / ".venv" / "bin" / "mutmut"
# links inside build/mutation (mutmut copies them into mutants/) and inside mutants/ (read by tests)
STAGE_LINKS = {"src": "custom", "tests": "tests", "pyproject.toml": "pyproject.toml"}
MUTANTS_LINKS = ("custom", "docs", "examples", "jobs", "benchmarks", "provisioning", "README.md", "Makefile")
# mutmut's exit codes (mutmut.stats.status_by_exit_code): caught = killed or timed out
CAUGHT = ("killed", "timeout")
#: how ``try`` names a kill where the test module itself fails to import with the mutant
IMPORT_FAILS = "(its import fails with the mutant)"
# a module's status once measured: every mutant triaged, or some still to triage
RUN, RUN_OPEN = "run", "run, survivors open"
MEASURED = (RUN, RUN_OPEN)


def was_run(entry: dict | None) -> bool:
    """Whether a report entry records a measured run (decided or not)."""
    return (entry or {}).get("status") in MEASURED


def _undecided(entry: dict) -> int:
    """Mutants still to triage: survivors of the last run not decided equivalent (``open``, or killed by
    a test in a ``try`` that the next run is still to confirm), and survivors of the first run that a
    later run caught whose killing test is not yet named (``open``)."""
    still = sum(not s["verdict"].startswith("equivalent: ") for s in entry["survivors"])
    return still + sum(c["verdict"] == "open" for c in entry.get("caught_since_before", []))


def _with_status(entry: dict) -> dict:
    """``run`` when every survivor is decided, ``run, survivors open`` while one is not."""
    entry["status"] = RUN_OPEN if _undecided(entry) else RUN
    return entry


def _kept(entry: dict, verdicts: dict) -> dict:
    """The last record of a module whose meta file is not here, with today's verdicts of its mutants
    (a verdict decided by hand since; one whose diff no longer matches stays as recorded)."""
    for group in ("survivors", "caught_since_before", "rewritten_since_before"):
        for item in entry.get(group, []):
            known = verdicts.get(item["mutant"])
            if known is not None and known["diff"] == item["diff"]:
                item["verdict"] = known["verdict"]
    return _with_status(entry)


def configured_patterns() -> list[str]:
    """[tool.mutmut] only_mutate: the modules mutated, as paths in build/mutation (src/fedweigh/...)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # mutmut's own dependency on Python 3.10
        import toml as tomllib
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    return list(config["only_mutate"])


def configured_modules() -> list[str]:
    """Every module of only_mutate, as a path from the project root (custom/fedweigh/...), sorted."""
    modules = set()
    for pattern in configured_patterns():
        for path in (ROOT / "custom").rglob("*.py"):
            staged = "src/" + path.relative_to(ROOT / "custom").as_posix()
            if fnmatch.fnmatch(staged, pattern):
                modules.add(path.relative_to(ROOT).as_posix())
    return sorted(modules)


def import_name(module: str) -> str:
    """custom/fedweigh/losses/focal.py -> fedweigh.losses.focal; a package's __init__.py -> the package."""
    parts = Path(module).with_suffix("").parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def file_sha256(module: str) -> str:
    return hashlib.sha256((ROOT / module).read_bytes()).hexdigest()


def stale_modules(payload: dict) -> dict[str, str]:
    """The measured modules whose file changed since their score was measured: module -> the command
    that measures it again. A stale score describes an older file; it is no failure of the code."""
    return {
        module: f"make mutation MODULES={module}"
        for module, entry in payload.get("modules", {}).items()
        if was_run(entry)
        and (not (ROOT / module).is_file() or entry["after"]["sha256"] != file_sha256(module))
    }


def print_stale(payload: dict) -> dict[str, str]:
    """Print which scores are stale (the modules changed since their run) and how to refresh each."""
    stale = stale_modules(payload)
    if not stale:
        print("mutation scores: every measured module is as it was when its score was measured")
    for module, command in stale.items():
        print(f"mutation score of {module} is stale (the file changed since its run): {command}")
    return stale


def _link(link: Path, target: Path) -> None:
    if link.is_symlink() or link.exists():
        if link.is_symlink() and link.resolve() == target.resolve():
            return
        raise SystemExit(f"{link} exists and is not a link to {target}: remove {STAGE} and run again")
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def stage() -> None:
    """build/mutation with its links (see the module docstring)."""
    for name, target in STAGE_LINKS.items():
        _link(STAGE / name, ROOT / target)
    for name in MUTANTS_LINKS:
        if (ROOT / name).exists():
            _link(MUTANTS / name, ROOT / name)


def expand(requested: list[str]) -> list[str]:
    """Requested paths (modules or folders, from the project root) -> configured modules, in that order."""
    configured = configured_modules()
    if not requested:
        return configured
    modules: list[str] = []
    for item in requested:
        item = item.rstrip("/")
        found = [m for m in configured if m == item or m.startswith(item + "/")]
        if not found:
            raise SystemExit(
                f"MODULES: {item} is not a module of [tool.mutmut] only_mutate in pyproject.toml "
                f"(those are: {' '.join(configured)})"
            )
        modules += [m for m in found if m not in modules]
    return modules


def run_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HYPOTHESIS_PROFILE="mutation",
        FEDWEIGH_TEST_ORDER="given",
        FEDWEIGH_MUTATION_RUN="1",  # tests/conftest.py leaves out the test of this report
        FEDWEIGH_CACHE=str(ROOT / ".cache" / "test-data"),
        OMP_NUM_THREADS="1",
        # subprocesses a test starts (the CLI) import this tree's package, unmutated
        PYTHONPATH=str(ROOT / "custom"),
    )
    return env


def meta_path(module: str) -> Path:
    return MUTANTS / "src" / (Path(module).relative_to("custom").as_posix() + ".meta")


def run(modules: list[str], nice: int, resume: bool = False, jobs: int = 1) -> dict[str, float | None] | None:
    """One ``mutmut run`` over ``modules``; its wall time for each of them, or None if it stopped.

    ``resume``: keep the results of a run that stopped half-way (mutmut then runs only the mutants
    without one); the time recorded is that of this run only. ``jobs``: mutants checked at once
    (mutmut's ``--max-children``; each runs its tests in one process)."""
    stage()
    with_mutants = []
    for module in modules:
        if meta_path(module).exists() and not json.loads(meta_path(module).read_text())["exit_code_by_key"]:
            print(f"{module}: no mutants")
        else:
            with_mutants.append(module)
    if not with_mutants:
        return dict.fromkeys(modules, 0.0)
    for module in with_mutants:  # forget the last results, so that a run stopped half-way shows as such
        if meta_path(module).exists() and not resume:
            meta = json.loads(meta_path(module).read_text())
            meta["exit_code_by_key"] = dict.fromkeys(meta["exit_code_by_key"])
            meta_path(module).write_text(json.dumps(meta, indent=4))
    names = [import_name(module) + ".x*" for module in with_mutants]
    command = ["nice", "-n", str(nice), str(MUTMUT), "run", "--max-children", str(jobs), *names]
    print(f"{' '.join(with_mutants)}: {' '.join(command[3:])}", flush=True)
    log = STAGE / "logs" / (names[0].removesuffix(".x*") + ".log")
    done, seconds = _mutmut(command, log)
    if done.returncode != 0:  # the report keeps what was measured; a module not finished stays "not yet run"
        tail = log.read_text(errors="replace")[-3000:]
        print(
            f"mutmut stopped on {' '.join(with_mutants)} (exit {done.returncode}):\n{tail}", file=sys.stderr
        )
        return None
    print(f"{' '.join(with_mutants)}: {seconds:.0f} s", flush=True)
    return dict.fromkeys(modules, seconds)


def _mutmut(command: list[str], log: Path) -> tuple[subprocess.CompletedProcess, float]:
    """Run a mutmut command in the stage, its output in ``log`` (followed while it runs); (done, seconds)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log, "w") as out:
        done = subprocess.run(command, cwd=STAGE, env=run_env(), stdout=out, stderr=subprocess.STDOUT)
    return done, round(time.monotonic() - start, 1)


def _recount(counts: dict[str, int], old: str, new: str) -> None:
    """Move one mutant from status ``old`` to ``new`` in a report's counts (keys: statuses, ``_`` for spaces)."""
    counts[old.replace(" ", "_")] -= 1
    key = new.replace(" ", "_")
    counts[key] = counts.get(key, 0) + 1


def recheck(module: str, nice: int, jobs: int = 1) -> dict:
    """Run the undecided survivors of ``module``'s last record through mutmut again (``mutmut run NAME...``,
    mutmut's own choice of tests), for survivors a test was written for since the run; the record's
    score then counts the ones caught. The other mutants' results stand as the run measured them, so the
    file must be the one the run mutated (its sha256). Recorded in ``after["rechecked"]``; a survivor the
    recheck does not catch keeps its place, its verdict back to ``open`` if it named a killing test."""
    payload = _load(SCORE_JSON, {})
    entry = payload.get("modules", {}).get(module)
    if not was_run(entry):
        raise SystemExit(f"{module}: no measured run to recheck; run `make mutation MODULES={module}`")
    if entry["after"]["sha256"] != file_sha256(module):
        raise SystemExit(f"{module}: changed since its last run; run `make mutation MODULES={module}` again")
    names = [s["mutant"] for s in entry["survivors"] if not s["verdict"].startswith("equivalent: ")]
    if not names:
        print(f"{module}: every survivor is decided equivalent; nothing to recheck")
        return entry
    stage()
    command = ["nice", "-n", str(nice), str(MUTMUT), "run", "--max-children", str(jobs), *names]
    print(f"{module}: rechecking {len(names)} survivors", flush=True)
    log = STAGE / "logs" / (import_name(module) + ".recheck.log")
    done, seconds = _mutmut(command, log)
    if done.returncode != 0:
        raise SystemExit(
            f"mutmut stopped on the recheck of {module} (exit {done.returncode}):\n"
            + log.read_text(errors="replace")[-3000:]
        )
    codes = json.loads(meta_path(module).read_text())["exit_code_by_key"]
    verdicts = _load(VERDICTS, {})
    after, kept, caught = entry["after"], [], []
    for survivor in entry["survivors"]:
        status = _status(codes.get(survivor["mutant"])) if survivor["mutant"] in names else None
        if status in CAUGHT:
            _recount(after["counts"], survivor["status"], status)
            after["counts"]["caught"] += 1
            caught.append({k: survivor[k] for k in ("mutant", "diff", "verdict")} | {"status": status})
            continue
        if status is not None and survivor["verdict"].startswith("killed by"):
            print(f"{survivor['mutant']}: {status} in the recheck, though {survivor['verdict']}", flush=True)
            survivor["verdict"] = "open"
            verdicts[survivor["mutant"]]["verdict"] = "open"
        if status is not None:  # still not caught, perhaps differently (e.g. no tests before, survived now)
            _recount(after["counts"], survivor["status"], status)
            survivor["status"] = status
        kept.append(survivor)
    after["counts"] = {k: v for k, v in after["counts"].items() if v or k in ("total", "caught")}
    after["score"] = score(after["counts"])
    after["survivors"] = [s["mutant"] for s in kept]
    after.setdefault("rechecked", []).append(
        {
            "at": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "seconds": seconds,
            "mutants": len(names),
            "caught": [s["mutant"] for s in caught],
        }
    )
    entry["survivors"] = kept
    first = set(entry["before"]["survivors"])
    known = {c["mutant"] for c in entry["caught_since_before"]}
    entry["caught_since_before"] += [
        {k: s[k] for k in ("mutant", "diff", "verdict")} for s in caught if s["mutant"] in first - known
    ]
    payload["modules"][module] = _with_status(entry)
    atomic_write_json(SCORE_JSON, payload, private=False, indent=1, sort_keys=False)
    atomic_write_json(VERDICTS, dict(sorted(verdicts.items())), private=False, indent=1)
    atomic_write_text(SCORE_MD, markdown(payload), private=False)
    _update_testing_page(payload)
    print(f"{module}: {len(caught)} of {len(names)} caught in {seconds:.0f} s; score {after['score']}%")
    return entry


def _status(code: int | None) -> str:
    from mutmut.stats import status_by_exit_code

    return status_by_exit_code[code]


def _diff(mutant: str) -> str:
    done = subprocess.run(
        [str(MUTMUT), "show", mutant], cwd=STAGE, env=run_env(), capture_output=True, text=True, check=True
    )
    lines = done.stdout.splitlines()
    return "\n".join(line for line in lines[1:] if not line.startswith(("---", "+++")))


def _counts(codes: dict[str, int | None]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for code in codes.values():
        status = _status(code).replace(" ", "_")
        counts[status] = counts.get(status, 0) + 1
    counts["total"] = len(codes)
    counts["caught"] = sum(counts.get(s, 0) for s in CAUGHT)
    return counts


def score(counts: dict[str, int]) -> float | None:
    return round(100.0 * counts["caught"] / counts["total"], 1) if counts["total"] else None


def _load(path: Path, default):
    return json.loads(path.read_text()) if path.exists() else default


def module_result(
    module: str, seconds: float | None, previous: dict | None, verdicts: dict, fresh: bool = True
) -> dict:
    """The report entry of one module from mutmut's meta file (see the module docstring)."""
    meta = json.loads(meta_path(module).read_text())
    codes: dict[str, int | None] = meta["exit_code_by_key"]
    if any(code is None for code in codes.values()):
        raise SystemExit(
            f"{module}: mutmut has not checked every mutant; run `make mutation MODULES={module}`"
        )
    counts = _counts(codes)
    survivors = []
    for mutant in sorted(codes, key=lambda m: (m.rsplit("__mutmut_", 1)[0], int(m.rsplit("_", 1)[1]))):
        status = _status(codes[mutant])
        if status in CAUGHT:
            continue
        diff = _diff(mutant)
        known = verdicts.get(mutant)
        if known is None or known["diff"] != diff:  # a new survivor, or the name now means another change
            verdicts[mutant] = known = {"module": module, "diff": diff, "verdict": "open"}
        survivors.append({"mutant": mutant, "status": status, "diff": diff, "verdict": known["verdict"]})
    after = {
        "sha256": file_sha256(module),
        "run_at": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "seconds": seconds if fresh else (previous or {}).get("after", {}).get("seconds"),
        "mutant_seconds": round(sum(meta["durations_by_key"].values()), 1),
        "counts": counts,
        "score": score(counts),
        "survivors": [s["mutant"] for s in survivors],
    }
    before = previous["before"] if was_run(previous) else after
    if not fresh and was_run(previous):
        after["run_at"] = previous["after"]["run_at"]  # the report rebuilt, not rerun
        if "rechecked" in previous["after"]:  # the meta file holds the rechecks' results: their record stays
            after["rechecked"] = previous["after"]["rechecked"]
    # survivors of the first run that a later run caught: their verdict names the test that kills them;
    # a survivor whose line was rewritten since (its name now means another change, or no longer
    # exists) is listed apart: the mutant is gone, and the rewritten code's own mutants are in ``after``
    caught_since, rewritten = [], []
    known_rewritten = (  # a report rebuilt without a new run keeps the last run's finding
        {x["mutant"] for x in previous.get("rewritten_since_before", [])} if previous and not fresh else None
    )
    for m in before["survivors"]:
        if m not in verdicts or m in after["survivors"]:
            continue
        if known_rewritten is not None:
            same = m not in known_rewritten
        else:
            same = m in codes and _status(codes[m]) in CAUGHT and _diff(m) == verdicts[m]["diff"]
        if same:
            caught_since.append({"mutant": m, "diff": verdicts[m]["diff"], "verdict": verdicts[m]["verdict"]})
        else:
            verdicts[m]["verdict"] = (
                "rewritten: the code this mutant changed was rewritten since the first run"
            )
            rewritten.append({"mutant": m, "diff": verdicts[m]["diff"], "verdict": verdicts[m]["verdict"]})
    return _with_status(
        {
            "status": RUN,
            "before": before,
            "after": after,
            "survivors": survivors,
            "caught_since_before": caught_since,
            "rewritten_since_before": rewritten,
        }
    )


def report(
    seconds: dict[str, float | None] | None = None, together: dict[str, list[str]] | None = None
) -> dict:
    """Rewrite score.json and score.md from mutmut's meta files (modules run now or before)."""
    import mutmut

    seconds = seconds or {}
    previous = _load(SCORE_JSON, {}).get("modules", {})
    verdicts = _load(VERDICTS, {})
    modules = {}
    for module in configured_modules():
        ran = module in seconds or was_run(previous.get(module))
        if module not in seconds and was_run(previous.get(module)) and not meta_path(module).exists():
            modules[module] = _kept(previous[module], verdicts)  # a fresh clone: the last record stands
            continue
        codes = (
            json.loads(meta_path(module).read_text())["exit_code_by_key"]
            if meta_path(module).exists()
            else {}
        )
        checked = sum(code is not None for code in codes.values())
        if ran and checked < len(codes):  # a run stopped before its end: the last complete one stands
            stopped = {"status": f"not yet run (stopped at {checked} of {len(codes)} mutants)"}
            modules[module] = _kept(previous[module], verdicts) if was_run(previous.get(module)) else stopped
        elif ran and codes:
            fresh = module in seconds  # measured now (its time None when not known) or the last record
            modules[module] = module_result(
                module, seconds.get(module), previous.get(module), verdicts, fresh
            )
            if together and len(together.get(module, [])) > 1:
                modules[module]["after"]["run_with"] = [m for m in together[module] if m != module]
            elif "run_with" in previous.get(module, {}).get("after", {}):  # a rebuilt report keeps it
                modules[module]["after"]["run_with"] = previous[module]["after"]["run_with"]
        elif ran:
            modules[module] = {"status": "no mutants", "sha256": file_sha256(module)}
        else:
            modules[module] = {"status": "not yet run"}
    payload = {
        "command": "make mutation MODULES=<module>",
        "tool": f"mutmut {mutmut.__version__}",
        "tests": "pytest tests -m 'not slow' (the tests mutmut found calling the mutated function)",
        "score": "caught / total, caught = killed or timed out; every other mutant is listed with a verdict",
        "modules": modules,
    }
    atomic_write_json(SCORE_JSON, payload, private=False, indent=1, sort_keys=False)
    atomic_write_json(VERDICTS, dict(sorted(verdicts.items())), private=False, indent=1)
    atomic_write_text(SCORE_MD, markdown(payload), private=False)
    _update_testing_page(payload)
    return payload


TESTING_MD = ROOT / "docs" / "testing.md"
TABLE_START = "<!-- mutation-score-table: benchmarks/mutation_score.py table(score.json) -->\n"
TABLE_END = "<!-- /mutation-score-table -->"


def _update_testing_page(payload: dict) -> None:
    """docs/testing.md's scores table, between its two markers, is the table of score.json."""
    text = TESTING_MD.read_text()
    head, found, rest = text.partition(TABLE_START)
    if not found or TABLE_END not in rest:
        return
    atomic_write_text(
        TESTING_MD, head + TABLE_START + table(payload) + rest[rest.index(TABLE_END) :], private=False
    )


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}%"


def _open(entry: dict) -> str:
    n = _undecided(entry)
    return f" ({n} open)" if n else ""


def table(payload: dict) -> str:
    """The scores table (docs/testing.md shows this table verbatim)."""
    rows = [
        "| module | mutants | caught before | score before | caught after | score after | not caught "
        "| mutants' tests (s) | run (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for module, entry in payload["modules"].items():
        name = module.removeprefix("custom/fedweigh/")
        if not was_run(entry):
            rows.append(f"| `{name}` | {entry['status']} | | | | | | | |")
            continue
        before, after = entry["before"], entry["after"]
        rows.append(
            f"| `{name}` | {after['counts']['total']} | {before['counts']['caught']} | {_pct(before['score'])} "
            f"| {after['counts']['caught']} | {_pct(after['score'])} | {len(entry['survivors'])}{_open(entry)} "
            f"| {after['mutant_seconds']} | {after['seconds'] if after['seconds'] is not None else '-'}"
            f"{'*' if after.get('run_with') else ''} |"
        )
    return "\n".join(rows) + "\n"


def markdown(payload: dict) -> str:
    lines = [
        "# Mutation score of the core modules",
        "",
        f"Built by `benchmarks/mutation_score.py` ({payload['tool']}, `{payload['command']}`) from "
        "`score.json` beside it. Tests: the fast suite. Score: " + payload["score"] + ". "
        "`mutants' tests (s)`: mutmut's time for the tests of the module's mutants (the last run); `run (s)`: "
        "wall time of the `mutmut run` that ran the module (set-up, clean run, forced failure, mutants) on a "
        "shared 2-core machine, one worker, `nice 15`; `*`: one run for several modules (`--together`); "
        "`(n open)`: mutants still to triage (status `run, survivors open`): survivors not yet decided "
        "equivalent, and survivors of the first run that the last run caught whose killing test is not yet named.",
        "",
        table(payload),
    ]
    for module, entry in payload["modules"].items():
        if not was_run(entry) or not (
            entry["survivors"] or entry["caught_since_before"] or entry.get("rewritten_since_before")
        ):
            continue
        lines += [f"## `{module}`", "", f"sha256 `{entry['after']['sha256']}`", ""]
        for r in entry["after"].get("rechecked", []):
            lines += [
                f"Rechecked {r['at']} (`mutation_score.py recheck`, {r['seconds']:.0f} s): "
                f"{len(r['caught'])} of its {r['mutants']} undecided survivors caught.",
                "",
            ]
        for group, title in (
            ("caught_since_before", "caught since the first run"),
            ("rewritten_since_before", "rewritten since the first run"),
            ("survivors", "not caught"),
        ):
            for s in entry.get(group, []):
                lines += [f"- `{s['mutant']}` ({title}): {s['verdict']}", "", "  ```diff"]
                lines += ["  " + line for line in s["diff"].splitlines()] + ["  ```", ""]
    return "\n".join(lines).rstrip() + "\n"


def slow_check(module: str, tests: list[str], controls: list[str], nice: int) -> dict:
    """Do the slow tests catch a mutant of ``module`` that the fast tests let through?

    Every mutant the fast run did not catch is run against ``tests`` (slow ones, e.g. the simulator
    runs that use the module), with the mutated package first on the path of every process the tests
    start (``PYTHONPATH``; mutmut selects the mutant by ``MUTANT_UNDER_TEST``, which they inherit).
    Controls: the tests pass with no mutant, and fail on the ``controls``, mutants the fast tests
    caught that change what the slow tests see (so the mutated code does reach them).
    Written to docs/results/mutations/slow_check.json under the module's name (other modules' checks kept).
    """
    meta = json.loads(meta_path(module).read_text())["exit_code_by_key"]
    missed = [m for m, code in meta.items() if _status(code) not in CAUGHT]
    for control in controls:
        if control not in meta or _status(meta[control]) not in CAUGHT:
            raise SystemExit(f"--controls: {control} is not a mutant of {module} that the fast tests caught")
    runs = [("", "control: no mutant")] + [(m, "control: caught by the fast tests") for m in controls]
    runs += [(m, "not caught by the fast tests") for m in missed]
    results = []
    for mutant, role in runs:
        start = time.monotonic()
        done, failed = _pytest(["-x", *tests], mutant, nice, cwd=MUTANTS)
        results.append(
            {
                "mutant": mutant or None,
                "role": role,
                "returncode": done.returncode,
                "failed": failed,
                "seconds": round(time.monotonic() - start, 1),
            }
        )
        print(f"{mutant or '(none)'} [{role}]: exit {done.returncode} {failed}", flush=True)
        if not mutant and done.returncode != 0:  # the slow tests must pass as they are, or nothing is shown
            raise SystemExit(
                f"the slow tests fail with no mutant (exit {done.returncode}):\n{done.stdout[-2000:]}"
            )
    payload = {
        "sha256": file_sha256(module),
        "tests": tests,
        "runs": results,
    }
    checks = _load(RESULTS / "slow_check.json", {})  # module -> its last check
    checks[module] = payload
    atomic_write_json(RESULTS / "slow_check.json", dict(sorted(checks.items())), private=False, indent=1)
    return payload


def _pytest(
    args: list[str], mutant: str, nice: int, cwd: Path = ROOT
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run pytest on ``args`` with ``mutant`` switched on ("" for none): the mutated copy first on the
    path of the tests and of every process they start; (the finished run, the failed tests)."""
    env = run_env()
    env.update(MUTANT_UNDER_TEST=mutant, PYTHONPATH=str(MUTANTS / "src"))
    command = ["nice", "-n", str(nice), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    return done, failed_tests(done.stdout)


def failed_tests(summary: str) -> list[str]:
    """The tests pytest's short summary reports as failed or erred (in set-up), and, as ``<module>
    (its import fails ...)``, the test modules that could not be collected."""
    failed = set(re.findall(r"^(?:FAILED|ERROR) (\S+::\S+)", summary, re.M))
    failed |= {f"{path} {IMPORT_FAILS}" for path in re.findall(r"^ERROR (\S+\.py)(?: - |$)", summary, re.M)}
    return sorted(failed)


def try_mutants(mutants: list[str], tests: list[str], nice: int) -> dict[str, list[str]]:
    """The tests that fail on each mutant (see the module docstring); verdicts.json records the kills."""
    paths = [t if t.startswith("-") else str(ROOT / t) for t in tests]  # options pass as they are
    done, failed = _pytest(paths, "", nice)
    code = done.returncode
    if code != 0:
        raise SystemExit(
            f"the tests fail with no mutant ({' '.join(failed) or f'exit {code}'}): fix them first"
        )
    verdicts = _load(VERDICTS, {})
    kills: dict[str, list[str]] = {}
    for mutant in mutants:
        done, failed = _pytest(paths, mutant, nice)
        kills[mutant] = failed if done.returncode != 0 else []
        print(f"{mutant}: {'killed by ' + ' '.join(failed) if kills[mutant] else 'not killed'}", flush=True)
        known = verdicts.get(mutant)
        if kills[mutant] and known is not None and not known["verdict"].startswith("killed by"):
            known["verdict"] = f"killed by {kills[mutant][0]}"
    atomic_write_json(VERDICTS, dict(sorted(verdicts.items())), private=False, indent=1)
    return kills


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("action", choices=("run", "report", "slow-check", "try", "recheck", "stale"))
    parser.add_argument("modules", nargs="*", help="modules or folders from the project root (default: all)")
    parser.add_argument(
        "--together", action="store_true", help="one mutmut run for all the modules (its set-up once)"
    )
    parser.add_argument("--nice", type=int, default=15, help="niceness of the mutmut runs (default 15)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="run: go on from a run that stopped half-way (keep the mutants it checked)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="run: mutants checked at once (default 1)")
    parser.add_argument(
        "--tests", nargs="+", default=[], help="slow-check, try: the tests to run on each mutant"
    )
    parser.add_argument(
        "--controls", nargs="*", default=[], help="slow-check: caught mutants run as controls"
    )
    args = parser.parse_intermixed_args(argv)
    if args.action == "stale":
        print_stale(_load(SCORE_JSON, {}))
        return 0
    if args.action == "run":
        modules = expand(args.modules)
        groups = [modules] if args.together else [[module] for module in modules]
        seconds: dict[str, float] = {}
        together: dict[str, list[str]] = {}
        for group in groups:  # the report after each run, so that a stopped run keeps what it measured
            measured = run(group, args.nice, args.resume, args.jobs)
            seconds.update(measured or dict.fromkeys(group))
            together.update({module: group for module in group})
            report(seconds, together)
            if measured is None:
                return 1
    elif args.action == "slow-check":
        if len(args.modules) != 1 or not args.tests:
            parser.error("slow-check takes one module and --tests")
        stage()
        slow_check(expand(args.modules)[0], args.tests, args.controls, args.nice)
        return 0
    elif args.action == "recheck":
        for module in expand(args.modules):
            recheck(module, args.nice, args.jobs)
    elif args.action == "try":
        if not args.modules or not args.tests:
            parser.error("try takes mutant names and --tests")
        kills = try_mutants(args.modules, args.tests, args.nice)
        return 0 if all(kills.values()) else 1
    else:  # modules named here count as run when mutmut checked all their mutants (the last time recorded kept)
        previous = _load(SCORE_JSON, {}).get("modules", {})
        report(
            {m: previous.get(m, {}).get("after", {}).get("seconds") for m in expand(args.modules)}
            if args.modules
            else None
        )
    print(table(json.loads(SCORE_JSON.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
