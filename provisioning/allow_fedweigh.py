"""Add the fedweigh entries of provisioning/resources.json to a site's class allow-list.

    python3 allow_fedweigh.py <kit folder> [<kit folder> ...]

NVFlare 2.9 reads a site's ``local/resources.json`` in place of ``local/resources.json.default``
(the files are not merged), and a ``class_allow_list`` found there replaces the built-in list.
This script therefore starts from the site's ``resources.json`` if it has one, else from the
``resources.json.default`` provisioning wrote, appends the entries of ``resources.json`` next to
this script that are missing, removes the package prefix ``fedweigh.`` that earlier versions added
(it admitted every function of the package, not only its components), and writes
``local/resources.json``. Running it twice changes nothing. Standard library only: it runs at a
server or site without fedweigh installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FRAGMENT = Path(__file__).resolve().with_name("resources.json")
KEY = "class_allow_list"
#: Entries earlier versions added and that must not stay: they admit more than fedweigh's components.
RETIRED = ("fedweigh.",)


def allow_list_entries(fragment: Path = FRAGMENT) -> list[str]:
    """The class paths the fragment adds (exact component classes)."""
    entries = json.loads(fragment.read_text()).get(KEY)
    if not isinstance(entries, list) or not all(isinstance(e, str) and "." in e for e in entries):
        raise ValueError(
            f"{fragment}: {KEY!r} must be a list of dotted class paths or prefixes ending in '.'"
        )
    return entries


def allow(kit: Path, entries: list[str]) -> list[str]:
    """Write ``kit/local/resources.json`` with ``entries`` in its allow-list; returns the entries added."""
    local = kit / "local"
    current, default = local / "resources.json", local / "resources.json.default"
    source = current if current.is_file() else default
    if not source.is_file():
        raise FileNotFoundError(
            f"{kit} is not a server or site startup kit: neither {current} nor {default} exists"
        )
    resources = json.loads(source.read_text())
    allow_list = resources.get(KEY)
    if not isinstance(allow_list, list):
        raise ValueError(
            f"{source} has no {KEY!r} list; copy the {KEY!r} of a freshly provisioned "
            "resources.json.default into it first"
        )
    removed = [e for e in allow_list if e in RETIRED]
    for entry in removed:
        allow_list.remove(entry)
        print(f"{current}: removed the package prefix {entry!r} (it admits every function of the package)")
    added = [e for e in entries if e not in allow_list]
    allow_list.extend(added)
    current.write_text(json.dumps(resources, indent=2) + "\n")
    return added


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    entries = allow_list_entries()
    for kit in map(Path, argv):
        added = allow(kit, entries)
        print(f"{kit / 'local' / 'resources.json'}: added {added}" if added else f"{kit}: already allowed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
