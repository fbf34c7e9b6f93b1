"""The package's shape: one direction of dependency, NVFlare only under flare/, no import circles."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "custom" / "fedweigh"
#: The application entry point assembles the sub-commands of flare/ and bench/ (imported when they run).
ENTRY_POINTS = {"fedweigh.cli"}
#: Client API entry scripts shipped in jobs: each only calls the main() of an NVFlare glue module.
ENTRY_SCRIPTS = {"fedweigh.flare.fedweigh_client", "fedweigh.flare.monai_bundle_client"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, module_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_only_flare_imports_nvflare_and_nothing_below_imports_flare():
    for name, path in _modules().items():
        imported = _imports(path, module_level_only=False)
        if not name.startswith("fedweigh.flare"):
            assert not any(m.split(".")[0] == "nvflare" for m in imported), f"{name} imports NVFlare"
            if name not in ENTRY_POINTS:
                assert not any(m.startswith("fedweigh.flare") for m in imported), (
                    f"{name} imports fedweigh.flare"
                )
        if name.startswith("fedweigh.bench"):
            assert not any(m.startswith("fedweigh.flare") for m in imported), f"{name} imports fedweigh.flare"


def test_every_flare_module_is_nvflare_glue():
    for name, path in _modules().items():
        if name.startswith("fedweigh.flare.") and name not in ENTRY_SCRIPTS:
            imported = _imports(path, module_level_only=True)
            assert any(m.split(".")[0] == "nvflare" for m in imported), f"{name} does not import NVFlare"


def test_no_import_circles():
    modules = _modules()
    graph = {
        name: {m for m in _imports(path, module_level_only=True) if m in modules and m != name}
        for name, path in modules.items()
    }
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join([*trail[trail.index(nxt) :], nxt]))
            if nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])
