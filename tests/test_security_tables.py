"""docs/security.md's attack, front and honest-cost tables are the suites' own output for the JSON files
committed in docs/results/security/, each file's summary is what its runs give, and the text states no
setting (rounds, seeds, sites, command) its JSON does not hold."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

from fedweigh.bench.attacks import front_table, markdown_table, summary_line

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "security"
DOC = ROOT / "docs" / "security.md"
SUITES = sorted(RESULTS.glob("attacks-*.json"))
FRONT = sorted((RESULTS / "front").glob("*.json"))


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _body(path: Path) -> dict:
    return json.loads(path.read_text())


def test_the_suites_are_committed():
    names = {p.stem for p in SUITES}
    assert {
        "attacks-deploy",
        "attacks-deploy-he",
        "attacks-deploy-malformed",
        "attacks-deploy-he-only",
    } <= names


@pytest.mark.parametrize("path", SUITES, ids=lambda p: p.stem)
def test_each_suite_table_is_the_suites_output_for_its_committed_run(path):
    body = _body(path)
    assert body["complete"]
    assert markdown_table(body) in DOC.read_text()


@pytest.mark.parametrize("path", SUITES, ids=lambda p: p.stem)
def test_each_suites_summary_is_what_its_runs_give(path):
    """The summary recomputed from the runs, without the suite's own summarise."""
    body = _body(path)
    runs = body["runs"]

    def worst(k: int, n: int, he: bool) -> float | None:
        groups: dict[tuple[str, str], list[float]] = {}
        for r in runs:
            if bool(r.get("he")) == he and r["sites"] == k and len(r["attackers"]) == n and not r["crashed"]:
                if r["drop"] == r["drop"]:
                    groups.setdefault((r["attack"], r["scheme"]), []).append(r["drop"])
        return round(max(float(np.mean(v)) for v in groups.values()), 4) if groups else None

    he = any(r.get("he") for r in runs)
    assert body["summary"] == {
        "tried": len(runs),
        "crashed_or_stalled": sum(bool(r["crashed"] or r["stalled"]) for r in runs),
        "worst_auc_drop_one_of_4": worst(4, 1, False),
        "worst_auc_drop_one_of_8": worst(8, 1, False),
        "worst_auc_drop_two_of_8": worst(8, 2, False),
        "worst_auc_drop_he": worst(4, 1, True),
        "he": "run" if he else "not run",
    }
    assert summary_line(body["summary"]) in DOC.read_text()
    st = body["settings"]
    for r in runs:  # every run under the settings the file states
        assert r["rounds"] == st["rounds"] and r["seed"] in st["seeds"] and r["sites"] in st["sites"]
        assert len(r["attackers"]) in st["colluders"] and r["safeguards"] == st["safeguards"]
        assert bool(r.get("he")) == bool(st.get("he"))


def _suite_commands(text: str) -> list[list[str]]:
    """The suite commands docs/security.md shows (continuation lines joined)."""
    joined = text.replace("\\\n", " ")
    return [
        shlex.split(line.split("python -m fedweigh.bench.attacks", 1)[1])
        for line in joined.splitlines()
        if "python -m fedweigh.bench.attacks" in line and "--out" in line
    ]


def test_each_command_the_text_shows_is_the_one_its_json_was_made_with():
    text = DOC.read_text()
    commands = _suite_commands(text)
    assert commands, "docs/security.md shows no suite command"
    for argv in commands:
        at = argv.index("--out")
        out = ROOT / argv[at + 1]
        recorded = shlex.split(_body(out)["command"].split("python -m fedweigh.bench.attacks", 1)[1])
        mine = recorded.index("--out")
        # the same flags and values; the file it wrote to is the one the text names
        assert argv[:at] + argv[at + 2 :] == recorded[:mine] + recorded[mine + 2 :], out.name


def test_the_text_states_no_round_count_or_seed_list_the_runs_do_not_hold():
    section = (
        DOC.read_text()
        .split("## Bounded influence", 1)[1]
        .split("### What a round with the checks costs", 1)[0]
    )
    cost = _body(RESULTS / "safeguard-cost.json")
    rounds = {_body(p)["settings"]["rounds"] for p in [*SUITES, *FRONT]} | {cost["rounds"]}
    stated = {int(m) for m in re.findall(r"\b(\d+) rounds\b", section)}
    stated |= {int(m) for m in re.findall(r"--rounds (\d+)", section)}
    assert stated and stated <= rounds, stated - rounds
    seeds = {tuple(_body(p)["settings"]["seeds"]) for p in [*SUITES, *FRONT]} | {tuple(cost["seeds"])}
    for m in re.findall(r"--seeds ([\d,]+)", section):
        assert tuple(int(x) for x in m.split(",")) in seeds


def test_the_front_and_the_honest_cost_tables_are_the_benchmarks_output():
    text = DOC.read_text()
    cost = _load("bench_safeguard_cost")
    record = _body(RESULTS / "safeguard-cost.json")
    assert cost.markdown(record) in text
    assert FRONT, "no front committed"
    bodies = {p.stem: _body(p) for p in FRONT}
    assert front_table(bodies, record) in text


def test_the_round_time_figures_in_the_docs_are_the_committed_runs():
    record = json.loads((ROOT / "docs" / "results" / "round-time" / "round-time.json").read_text())
    text = " ".join(DOC.read_text().split())
    each = " and ".join(f"{r:.3f}" for r in record["round_time"]["ratio_per_repeat"])
    assert f"took {each} times a stock FedAvg round" in text
    assert f"ratio of the medians {record['round_time']['ratio_of_medians']:.3f}" in text
    server = record["server"]["server_seconds_10_densenet121"]
    assert (
        f"FedDRAW {server['feddraw']:.3f} s" in text
        and f"FedAvg's weights and aggregate {server['fedavg']:.3f} s" in text
    )


def test_the_suites_last_line_covers_every_committed_run():
    from fedweigh.bench.attacks import combined_line

    line = combined_line([_body(p) for p in SUITES])
    assert line in DOC.read_text()
    assert line.startswith(f"attacks: {sum(len(_body(p)['runs']) for p in SUITES)} tried, ")
