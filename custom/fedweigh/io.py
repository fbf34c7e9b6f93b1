"""Every file the package writes: atomic writes, so a reader (or a crash) never sees a half-written file.

    atomic_write(path, lambda tmp: np.savez(tmp, **arrays))
    atomic_write_text(path, json.dumps(state))
    atomic_write_text(report, markdown, private=False)

Each writes to a temporary file in the target's folder and renames it over the target
(``os.replace``, atomic on POSIX and Windows within one file system). A file is private to its owner
(mode 0600, as ``tempfile.mkstemp`` makes it) unless ``private=False``: then it gets the permissions an
ordinary ``open(path, "w")`` gives (0666 less the umask), for reports and job files meant to be
read by others. Two kinds of file are written in place: a figure (:func:`write_figure`, matplotlib
writes it) and a log a running process streams into (:func:`streamed_log`).
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = [
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_npz",
    "atomic_write_text",
    "streamed_log",
    "write_figure",
]


def _shared_temp_file(path: Path) -> str:
    """A new empty file next to ``path`` with the permissions ``open(..., "w")`` gives (0666 less the umask)."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return str(tmp)
    raise FileExistsError(f"no free temporary file name next to {path}")


def atomic_write(path: str | Path, write: Callable[[Path], None], *, private: bool = True) -> Path:
    """Call ``write(tmp)`` on a temporary file next to ``path``, then rename it to ``path``.

    The folder is created if needed; on any error the temporary file is removed and ``path`` is
    left as it was. ``write`` must write to exactly the path it is given (``np.savez`` on a path
    without ``.npz`` appends the suffix: pass an open file instead, see :func:`atomic_write_npz`).
    ``private``: the file is readable by its owner only (0600); otherwise as ``open(path, "w")`` makes it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if private:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
    else:
        tmp = _shared_temp_file(path)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_bytes(path: str | Path, data: bytes, *, private: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically."""
    return atomic_write(path, lambda tmp: tmp.write_bytes(data), private=private)


def atomic_write_text(path: str | Path, text: str, *, private: bool = True) -> Path:
    """Write ``text`` to ``path`` atomically."""
    return atomic_write(path, lambda tmp: tmp.write_text(text), private=private)


def atomic_write_json(path: str | Path, payload: Any, *, private: bool = True, **dump_options: Any) -> Path:
    """Write ``payload`` as JSON to ``path`` atomically (``dump_options`` go to ``json.dumps``)."""
    return atomic_write_text(path, json.dumps(payload, **dump_options), private=private)


def atomic_write_npz(path: str | Path, *, private: bool = True, **arrays: Any) -> Path:
    """Write ``arrays`` as an uncompressed ``.npz`` to ``path`` atomically (no suffix is added)."""
    import numpy as np

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)

    return atomic_write(path, write, private=private)


def write_figure(path: str | Path, figure: Any, **savefig_options: Any) -> Path:
    """Save a matplotlib ``figure`` to ``path`` (``savefig_options`` go to ``figure.savefig``), its folder
    created. Not atomic: matplotlib opens and writes the file itself."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, **savefig_options)
    return path


def streamed_log(path: str | Path) -> IO[str]:
    """``path`` opened for writing as a log a running process streams into (its folder created). Not
    atomic: a reader sees the log grow, which is the point of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("w")
