"""The committed mutation check (docs/results/mutations/mutations.json, docs/testing.md) is the one the
code still applies: every mutation of benchmarks/mutation_check.py was run as it stands, was caught,
still finds its text exactly once in today's code, and docs/testing.md shows that run's table."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "results" / "mutations" / "mutations.json"


def _module():
    spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "benchmarks" / "mutation_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


MODULE = _module()
RUN = json.loads(RECORD.read_text())


def test_the_record_is_a_run_of_todays_mutations_and_every_one_was_caught():
    assert [r["name"] for r in RUN] == [m.name for m in MODULE.MUTATIONS]
    for recorded, mutation in zip(RUN, MODULE.MUTATIONS, strict=True):
        for key, value in asdict(mutation).items():  # run as the list defines it now
            assert recorded[key] == (list(value) if isinstance(value, tuple) else value), (mutation.name, key)
        assert recorded["caught"] and recorded["returncode"] == 1 and recorded["failed"], mutation.name
        # the failures are the named tests' (a file names every test in it)
        assert all(any(f.startswith(t) for t in mutation.tests) for f in recorded["failed"]), mutation.name


@pytest.mark.parametrize("mutation", MODULE.MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_still_applies_to_the_code(mutation, tmp_path):
    source = ROOT / mutation.path
    (tmp_path / mutation.path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / mutation.path).write_text(source.read_text())
    MODULE.apply(mutation, tmp_path)  # ValueError unless the text occurs exactly once
    changed = (tmp_path / mutation.path).read_text()
    assert changed != source.read_text() and mutation.new in changed
    if source.suffix == ".py":
        compile(changed, str(source), "exec")  # the mutant is valid Python


def test_docs_testing_shows_the_records_table():
    assert MODULE.markdown(RUN) in (ROOT / "docs" / "testing.md").read_text()
