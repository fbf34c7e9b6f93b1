"""The package's shape: floors with one direction of dependency, two wings that never meet, NVFlare
only under flare/, and no import circle, function-local imports included."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "custom" / "fedweigh"
#: The application entry point assembles the sub-commands of flare/ and bench/ (imported when they run).
ENTRY_POINTS = {"fedweigh.cli"}
#: Client API entry scripts shipped in jobs: each only calls the main() of an NVFlare glue module.
ENTRY_SCRIPTS = {"fedweigh.flare.fedweigh_client", "fedweigh.flare.monai_bundle_client"}

#: The floors, bottom up: a module may import its own floor and the floors below, never one above.
#: The ground floor holds plain helpers and the errors; the wings are the server's round and the
#: hospital's side; the faces are what users drive (NVFlare glue, the benchmark, explain, the CLI).
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "ground",
        (
            "fedweigh.errors",
            "fedweigh.arrays",
            "fedweigh.io",
            "fedweigh.protocol",
            "fedweigh.schedules",
            "fedweigh.metrics",
            "fedweigh.plots",
            "fedweigh.imbalance",
            "fedweigh.kernels",
        ),
    ),
    (
        "core",
        (
            "fedweigh.weighting",
            "fedweigh.losses",
            "fedweigh.histograms",
            "fedweigh.data",
            "fedweigh.models",
            "fedweigh.train",
        ),
    ),
    ("security", ("fedweigh.secure",)),
    ("settings checks", ("fedweigh.checks",)),
    ("wings", ("fedweigh.server", "fedweigh.site")),
    ("method catalogue", ("fedweigh.methods",)),
    ("faces", ("fedweigh.flare", "fedweigh.bench", "fedweigh.explain")),
    ("entry point", ("fedweigh.cli",)),
)
#: The two wings: the server's round and the hospital's side import nothing of each other.
WINGS = ("fedweigh.server", "fedweigh.site")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, module_level_only: bool = False) -> set[str]:
    """Every module ``path`` imports (``from a import b`` gives ``a`` and ``a.b``); function-local
    imports included unless ``module_level_only``."""
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


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def floor_of(name: str) -> int:
    """The index in :data:`FLOORS` of a module (the package face ``fedweigh`` is the ground)."""
    if name == "fedweigh":
        return 0
    for index, (_, prefixes) in enumerate(FLOORS):
        if any(_within(name, p) for p in prefixes):
            return index
    raise AssertionError(f"{name} stands on no floor: add it to FLOORS in tests/test_layout.py")


def _package_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    return {m for m in _imports(path) if m in modules and m != name}


def test_every_module_stands_on_a_floor():
    for name in _modules():
        floor_of(name)


def test_no_arrow_runs_up_a_floor():
    modules = _modules()
    for name, path in modules.items():
        here = floor_of(name)
        for imported in _package_imports(name, path, modules):
            there = floor_of(imported)
            assert there <= here, (
                f"{name} ({FLOORS[here][0]}) imports {imported}, which stands higher ({FLOORS[there][0]})"
            )


def test_the_two_wings_never_import_each_other():
    modules = _modules()
    for name, path in modules.items():
        for wing in WINGS:
            if not _within(name, wing):
                continue
            other = next(w for w in WINGS if w != wing)
            for imported in _package_imports(name, path, modules):
                assert not _within(imported, other), f"{name} (in {wing}) imports {imported} (in {other})"


def test_only_flare_imports_nvflare_and_nothing_below_imports_flare():
    for name, path in _modules().items():
        imported = _imports(path)
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


def import_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*trail[trail.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt, [*trail, nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            found = visit(name, [name])
            if found:
                return found
    return None


def test_no_import_circles_function_local_imports_included():
    modules = _modules()
    graph = {name: _package_imports(name, path, modules) for name, path in modules.items()}
    circle = import_circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_a_function_local_import_circle_is_found(tmp_path):
    """The circle check reads imports inside functions too (the kind that hid checks <-> data)."""
    (tmp_path / "a.py").write_text("import fedweigh.b\n")
    (tmp_path / "b.py").write_text("def f():\n    from fedweigh.a import x\n")
    modules = {"fedweigh.a": tmp_path / "a.py", "fedweigh.b": tmp_path / "b.py"}
    graph = {name: _package_imports(name, path, modules) for name, path in modules.items()}
    assert import_circle(graph) == ["fedweigh.a", "fedweigh.b", "fedweigh.a"]


def test_all_lists_stand_at_the_top():
    """A module's ``__all__`` comes before its first definition, so a reader sees the public names first."""
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        first_def = next(
            (
                n.lineno
                for n in tree.body
                if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
            ),
            None,
        )
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                getattr(t, "id", None) == "__all__" for t in node.targets
            ):
                assert first_def is None or node.lineno < first_def, (
                    f"{name}: __all__ stands below a definition"
                )
