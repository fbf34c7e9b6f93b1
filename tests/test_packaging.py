"""Package metadata: the declared dependencies match the imports; torch is a range; the demo needs no dev tools."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "custom" / "fedweigh"


def _requirements(extras: bool = False) -> dict[str, Requirement]:
    """The declared dependencies (with ``extras``: the optional ones too) by lower-case name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    texts = list(project["dependencies"])
    if extras:
        texts += [r for group in project.get("optional-dependencies", {}).values() for r in group]
    return {Requirement(r).name.lower(): Requirement(r) for r in texts}


def _imported_top_modules() -> set[str]:
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"fedweigh"}


def test_every_imported_distribution_is_declared_and_every_declared_one_is_used():
    declared = _requirements()
    declared_or_optional = _requirements(extras=True)
    by_module = metadata.packages_distributions()
    used: set[str] = set()
    for module in _imported_top_modules():
        dists = {d.lower() for d in by_module.get(module, [])}
        if not dists and module.lower() in declared_or_optional:  # an optional extra not installed here
            continue
        assert dists, f"fedweigh imports {module!r}, which no installed distribution provides"
        assert dists & set(declared_or_optional), (
            f"fedweigh imports {module!r} ({sorted(dists)}), not declared"
        )
        used |= dists & set(declared)
    # needed without an import of ours: tensorboard (NVFlare's TensorBoard receiver writes the
    # events), einops (MONAI's ViT, an optional dependency of MONAI), pillow (MONAI's PILReader,
    # which our image pipeline loads files with)
    unused = set(declared) - used - {"tensorboard", "einops", "pillow"}
    assert not unused, f"declared but never imported: {sorted(unused)}"


def test_torch_is_a_range_that_includes_container_builds():
    torch = _requirements()["torch"]
    assert not any(s.operator == "==" for s in torch.specifier), torch
    for version in ("2.4.0", "2.6.0", "2.14.1"):
        assert torch.specifier.contains(version), (torch, version)
    # NVIDIA's PyTorch containers ship pre-release local builds such as 2.6.0a0+ecf3bae40a
    assert torch.specifier.contains("2.6.0a0+ecf3bae40a", prereleases=True)


def _make_rules() -> dict[str, tuple[list[str], list[str]]]:
    """Makefile target -> (prerequisites, recipe lines), with ``$(VAR)`` of ``VAR := value`` expanded."""
    makefile = (ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"^(\w+)\s*:=\s*(.*)$", makefile, re.M))

    def expand(text: str) -> str:
        return re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), text)

    rules = {}
    for match in re.finditer(r"^([^\s#.][^:=\n]*):(?!=)(.*)\n((?:\t.*\n?)*)", makefile, re.M):
        lines = [expand(line.strip()) for line in match.group(3).splitlines()]
        rules[expand(match.group(1).strip())] = (expand(match.group(2)).split(), lines)
    return rules


def _commands(rules, target: str) -> list[str]:
    prereqs, lines = rules.get(target, ([], []))
    return [c for p in prereqs for c in _commands(rules, p)] + lines


def test_make_demo_installs_no_dev_tools_and_make_test_does():
    rules = _make_rules()
    demo_installs = [c for c in _commands(rules, "demo") if "pip install" in c]
    assert demo_installs, rules["demo"]
    assert not any("[dev]" in c for c in demo_installs), demo_installs
    assert any("[dev]" in c for c in _commands(rules, "test") if "pip install" in c)


def test_every_distribution_the_tests_import_is_declared_for_make_test():
    """`make test` installs `.[dev]`: whatever the tests import must come from the package's own
    dependencies or the dev extra, never from something that happens to be installed here."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {Requirement(r).name.lower() for r in project["dependencies"]}
    declared |= {Requirement(r).name.lower() for r in project["optional-dependencies"]["dev"]}
    # the tests' own helpers and the examples' scripts they load (examples/*/ on sys.path)
    helpers = {p.stem for p in (ROOT / "tests").glob("*.py")} | {
        p.stem for p in (ROOT / "examples").rglob("*.py")
    }
    imported: set[str] = set()
    for path in (ROOT / "tests").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    imported -= set(sys.stdlib_module_names) | helpers | {"fedweigh"}
    by_module = metadata.packages_distributions()
    undeclared = {
        module: sorted(by_module.get(module, ["(not installed)"]))
        for module in sorted(imported)
        if not {d.lower() for d in by_module.get(module, [])} & declared
    }
    # pytest plugins and packaging come with the dev extra's pytest itself
    undeclared.pop("packaging", None)
    assert not undeclared, f"tests import these without a declaration in pyproject.toml: {undeclared}"


def _make_dry_run(target: str, *overrides: str, tmp_path) -> list[str]:
    out = subprocess.run(
        ["make", "-n", "-B", target, f"VENV={tmp_path / 'venv'}", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if "pip install" in line]


@pytest.mark.parametrize("target", ["setup", "dev"])
def test_make_cpu_1_installs_the_cpu_torch_wheel_before_the_package(target, tmp_path):
    installs = _make_dry_run(target, "CPU=1", tmp_path=tmp_path)
    assert len(installs) == 2, installs
    assert "--index-url https://download.pytorch.org/whl/cpu" in installs[0] and "torch" in installs[0]
    assert " -e " in installs[1] and "--index-url" not in installs[1]
    # without CPU=1 only the package is installed, from PyPI
    plain = _make_dry_run(target, tmp_path=tmp_path)
    assert len(plain) == 1 and "--index-url" not in plain[0], plain
