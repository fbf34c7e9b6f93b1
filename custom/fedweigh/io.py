"""Atomic file writing: a reader (or a crash) never sees a half-written file.

    atomic_write(path, lambda tmp: np.savez(tmp, **arrays))
    atomic_write_text(path, json.dumps(state))

Each writes to a temporary file in the target's folder and renames it over the target
(``os.replace``, atomic on POSIX and Windows within one file system).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_json", "atomic_write_npz", "atomic_write_text"]


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temporary file next to ``path``, then rename it to ``path``.

    The folder is created if needed; on any error the temporary file is removed and ``path`` is
    left as it was. ``write`` must write to exactly the path it is given (``np.savez`` on a path
    without ``.npz`` appends the suffix: pass an open file instead, see :func:`atomic_write_npz`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically."""
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically."""
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def atomic_write_json(path: str | Path, payload: Any, **dump_options: Any) -> Path:
    """Write ``payload`` as JSON to ``path`` atomically (``dump_options`` go to ``json.dumps``)."""
    return atomic_write_text(path, json.dumps(payload, **dump_options))


def atomic_write_npz(path: str | Path, **arrays: Any) -> Path:
    """Write ``arrays`` as an uncompressed ``.npz`` to ``path`` atomically (no suffix is added)."""
    import numpy as np

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)

    return atomic_write(path, write)
