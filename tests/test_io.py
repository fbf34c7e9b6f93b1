"""fedweigh.io: atomic writes and their permissions, figures and streamed logs, and the rule that every
file the package writes goes through it."""

from __future__ import annotations

import ast
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from fedweigh.io import (
    atomic_write,
    atomic_write_json,
    atomic_write_npz,
    atomic_write_text,
    streamed_log,
    write_figure,
)

PACKAGE = Path(__file__).resolve().parents[1] / "custom" / "fedweigh"
#: Modules that still write a file without fedweigh.io, with the write each holds (kept exact, so that
#: an entry goes once its module writes through io).
WRITES_ELSEWHERE = {}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def test_atomic_write_replaces_the_file_whole_and_keeps_it_on_failure(tmp_path):
    path = tmp_path / "sub" / "state.json"
    atomic_write_json(path, {"round": 1})
    assert json.loads(path.read_text()) == {"round": 1}

    def fail(tmp: Path) -> None:
        tmp.write_text("half")
        raise RuntimeError("crash while writing")

    with pytest.raises(RuntimeError):
        atomic_write(path, fail)
    assert json.loads(path.read_text()) == {"round": 1}
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json"]  # no temporary file left


def test_private_files_are_the_owners_alone_shared_ones_follow_the_umask(tmp_path):
    private = atomic_write_text(tmp_path / "key.bin", "secret")
    assert _mode(private) == 0o600
    shared = atomic_write_text(tmp_path / "report.md", "# report", private=False)
    assert shared.read_text() == "# report"
    assert _mode(shared) == 0o666 & ~_umask()
    arrays = atomic_write_npz(tmp_path / "cells.npz", private=False, scores=np.arange(3))
    assert _mode(arrays) == 0o666 & ~_umask()
    with np.load(arrays) as z:
        assert z["scores"].tolist() == [0, 1, 2]


def test_write_figure_and_streamed_log_create_their_folder(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1, 1))
    FigureCanvasAgg(fig)
    fig.subplots().plot([0, 1], [1, 0])
    out = write_figure(tmp_path / "plots" / "line.png", fig, dpi=50)
    assert out == tmp_path / "plots" / "line.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with streamed_log(tmp_path / "logs" / "run.log") as log:
        log.write("round 1\n")
        log.flush()
        assert (tmp_path / "logs" / "run.log").read_text() == "round 1\n"  # readable while it grows


def _in_memory_buffers(tree: ast.AST) -> set[str]:
    """Names bound to ``io.BytesIO(...)`` / ``io.StringIO(...)`` (writing to them writes no file)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("BytesIO", "StringIO"):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _writing_mode(call: ast.Call, position: int) -> bool:
    args = [*call.args[position : position + 1], *(k.value for k in call.keywords if k.arg == "mode")]
    return any(
        isinstance(a, ast.Constant) and isinstance(a.value, str) and set(a.value) & set("wax+") for a in args
    )


def file_writes(source: str) -> list[str]:
    """Every call in ``source`` that writes a file, as ``'<what> (line N)'``."""
    tree = ast.parse(source)
    buffers = _in_memory_buffers(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
        what = None
        if name in ("write_text", "write_bytes", "savefig") and isinstance(func, ast.Attribute):
            what = f".{name}(...)"
        elif name == "open" and isinstance(func, ast.Name) and _writing_mode(node, 1):
            what = "open(..., 'w')"
        elif (
            name in ("open", "fdopen")
            and isinstance(func, ast.Attribute)
            and _writing_mode(node, 0 if name == "open" else 1)
        ):
            what = f".{name}('w')"
        elif (owner, name) in {("json", "dump"), ("torch", "save"), ("pickle", "dump")}:
            what = f"{owner}.{name}(...)"
        elif owner in ("np", "numpy") and name in ("save", "savez", "savez_compressed", "savetxt"):
            first = node.args[0] if node.args else None
            if not (isinstance(first, ast.Name) and first.id in buffers):
                what = f"np.{name}(...)"
        elif name == "to_csv" and (node.args or any(k.arg == "path_or_buf" for k in node.keywords)):
            what = ".to_csv(path)"
        if what is not None:
            found.append((node.lineno, f"{what} (line {node.lineno})"))
    return [text for _, text in sorted(found)]


def test_the_write_finder_finds_each_kind_of_write():
    source = (
        "import io, json, numpy as np, torch\n"
        "def f(p, fig, frame, model):\n"
        "    p.write_text('x')\n"
        "    with open(p, 'wb') as fh:\n"
        "        json.dump({}, fh)\n"
        "    np.savez(p, a=1)\n"
        "    buf = io.BytesIO()\n"
        "    np.savez(buf, a=1)\n"
        "    torch.save(model, p)\n"
        "    fig.savefig(p)\n"
        "    frame.to_csv(p)\n"
        "    frame.to_csv(index=False)\n"
        "    p.open('a')\n"
        "    open(p).read()\n"
    )
    assert [w.split(" (")[0] for w in file_writes(source)] == [
        ".write_text(...)",
        "open(..., 'w')",
        "json.dump(...)",
        "np.savez(...)",
        "torch.save(...)",
        ".savefig(...)",
        ".to_csv(path)",
        ".open('w')",
    ]


def test_every_file_the_package_writes_goes_through_io():
    outside = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name == "fedweigh.io":
            continue
        writes = file_writes(path.read_text())
        if writes:
            outside[name] = writes
    for name, kind in WRITES_ELSEWHERE.items():
        assert any(w.startswith(kind) for w in outside.pop(name, [])), (
            f"{name} no longer writes with {kind}: drop it from WRITES_ELSEWHERE"
        )
    assert outside == {}, f"file writes outside fedweigh.io: {outside}"
