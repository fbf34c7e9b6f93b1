"""Checks on the files a site trusts (its policy, its privacy ledger, its DP accounts), as strict as
ssh's ``StrictModes``.

A site reads its policy and its privacy state from files; anyone who can change one of them can
loosen the policy or erase what the site has spent. :func:`check_private_file` therefore accepts a
file only if, after following symbolic links (the *target* is judged):

* it is a regular file owned by the site's user (``os.geteuid()``) or by root;
* neither its group nor other users may write it (no ``g+w``, no ``o+w``);
* the folder holding the target, and the folder holding every link on the way to it, is owned by
  the site's user or root and writable by its owner only: a user who can write a folder can
  replace the file in it (or re-point a link), whatever the file's own mode. A world-writable
  folder with the sticky bit (``/tmp``) is refused too: its other users may still create the file
  before the site does.

Each refusal is a :class:`PermissionError` naming the file (and the link's target), the problem,
the mode or owner found and the ``chmod``/``chown`` command that fixes it. On a system without POSIX
ownership (``os.geteuid`` missing: Windows) the check is skipped.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["check_private_file"]

#: ``os.readlink`` hops followed before a link chain is called a loop (Linux' own limit is 40).
MAX_LINK_HOPS = 40


def _owner_ok(uid: int, euid: int) -> bool:
    return uid in (euid, 0)


def _link_folders(path: Path) -> list[Path]:
    """The real folders that hold ``path`` and every symbolic link on the way to its target."""
    folders: list[Path] = []
    current = Path(os.path.abspath(path))
    for _ in range(MAX_LINK_HOPS):
        folder = Path(os.path.realpath(current.parent))
        if folder not in folders:
            folders.append(folder)
        if not current.is_symlink():
            return folders
        current = Path(os.path.abspath(folder / os.readlink(current)))
    raise PermissionError(
        f"{path}: more than {MAX_LINK_HOPS} symbolic links on the way to the file (a loop?)"
    )


def check_private_file(path: str | Path, what: str, risk: str = "anyone could change it") -> Path:
    """The real path of ``path`` if only the site's user (or root) can change it; else PermissionError.

    ``what`` names the file in messages (``"site policy"``), ``risk`` says what a writer could do
    (module docstring for the rules). FileNotFoundError if ``path`` does not exist.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    target = Path(os.path.realpath(path))
    if not hasattr(os, "geteuid"):  # pragma: no cover - no POSIX owners to judge (Windows)
        return target
    euid = os.geteuid()
    name = (
        f"{what} {path}" if target == Path(os.path.abspath(path)) else f"{what} {path} (a link to {target})"
    )
    info = os.stat(target)
    mode = stat.filemode(info.st_mode)
    if not stat.S_ISREG(info.st_mode):
        raise PermissionError(f"{name} is not a regular file (mode {mode})")
    if not _owner_ok(info.st_uid, euid):
        raise PermissionError(
            f"{name} is owned by uid {info.st_uid}, not by this site's user (uid {euid}) or root: its owner "
            f"could change it. Make it the site's own: chown {euid} {target}"
        )
    if info.st_mode & stat.S_IWOTH:
        bits = "o-w,g-w" if info.st_mode & stat.S_IWGRP else "o-w"
        raise PermissionError(
            f"{name} is writable by every user of this machine (mode {mode}): {risk}. "
            f"Make it writable by its owner only: chmod {bits} {target}"
        )
    if info.st_mode & stat.S_IWGRP:
        raise PermissionError(
            f"{name} is writable by its group (mode {mode}): any member of the group could change it. "
            f"Make it writable by its owner only: chmod g-w {target}"
        )
    for folder in _link_folders(path):
        held = os.stat(folder)
        folder_mode = stat.filemode(held.st_mode)
        if not _owner_ok(held.st_uid, euid):
            raise PermissionError(
                f"{name}: its folder {folder} is owned by uid {held.st_uid}, not by this site's user (uid {euid}) "
                f"or root: its owner could replace the file. Move the file to a folder of the site's user, "
                f"or: chown {euid} {folder}"
            )
        if held.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            sticky = (
                " (the sticky bit does not stop others creating it first)"
                if held.st_mode & stat.S_ISVTX
                else ""
            )
            raise PermissionError(
                f"{name}: its folder {folder} is writable by other users (mode {folder_mode}){sticky}: they could "
                f"replace the file. Make the folder writable by its owner only: chmod go-w {folder}"
            )
    return target
